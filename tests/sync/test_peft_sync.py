"""WeightSync over a PEFT model, without an engine: the base view and the refusals (the live
syncs are in tests/engines/test_vllm_lora.py)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from fastsync.control import TCPStoreControl  # noqa: E402
from fastsync.errors import ConfigError  # noqa: E402
from fastsync.sync import WeightSync  # noqa: E402
from fastsync.sync.peft_sync import PeftWeightSync, base_view  # noqa: E402

CONFIG = dict(vocab_size=101, hidden_size=40, intermediate_size=72, num_hidden_layers=2, num_attention_heads=5,
              num_key_value_heads=1, head_dim=8, tie_word_embeddings=False)


def _models(**lora):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**CONFIG))
    names = {n: p.detach().clone() for n, p in base.named_parameters()}
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], **lora)
    return names, get_peft_model(base, cfg)


def test_base_view_is_the_checkpoints_names_over_the_peft_models_own_tensors():
    names, pm = _models()
    view = base_view(pm)
    got = dict(view.named_parameters())
    assert sorted(got) == sorted(names)  # no lora_A/B, no base_layer
    assert all(torch.equal(got[n], names[n]) for n in names)
    q = pm.get_base_model().model.layers[1].self_attn.q_proj.base_layer.weight
    assert got["model.layers.1.self_attn.q_proj.weight"] is q  # the same tensor: an optimizer step shows
    with torch.no_grad():
        q.add_(1.0)
    assert torch.equal(dict(view.named_parameters())["model.layers.1.self_attn.q_proj.weight"], q)


def test_modules_to_save_is_refused_by_name():
    _, pm = _models(modules_to_save=["lm_head"])
    with pytest.raises(ConfigError, match="lm_head.*modules_to_save"):
        base_view(pm)


def test_the_constructor_chooses_by_the_model_and_refuses_what_it_cannot_do():
    _, pm = _models()
    control = TCPStoreControl.server(port=0)  # loopback; nothing connects to it here
    try:
        _refusals(pm, control)
    finally:
        control.close()


def _refusals(pm, control):
    with pytest.raises(ConfigError, match="lora=False.*PEFT"):
        WeightSync(pm, rank=0, world_size=1, control=control, lora=False)
    with pytest.raises(ConfigError, match="needs a PEFT model.*Qwen3ForCausalLM"):
        WeightSync(pm.get_base_model(), rank=0, world_size=1, control=control, lora=True)
    with pytest.raises(ConfigError, match="delta= and fanout="):
        WeightSync(pm, rank=0, world_size=1, control=control, delta=True)

    class NoLora:  # an engine handle without LoRA verbs
        pass

    with pytest.raises(ConfigError, match="engine handle 0 \\(NoLora\\) has no lora"):
        WeightSync(pm, rank=0, world_size=1, control=control, engines=[NoLora()])
    ws = WeightSync(pm, rank=1, world_size=2, control=control)
    assert isinstance(ws, PeftWeightSync) and not ws.lora.engines
