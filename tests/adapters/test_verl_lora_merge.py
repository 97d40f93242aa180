"""``fastsync_verl.lora_merge``: a PEFT LoRA actor's shards with the adapter merged on each rank
(verl's ``lora.merge=True``), in one process on plain (unsharded) tensors: the merge math against
PEFT's own ``merge_and_unload()`` (rsLoRA, two active adapters), and the refusals, each naming
what a local merge cannot stand for. The FSDP2 two-rank case (uneven shards, A gathered, no
``full_tensor()``) runs verl's real export in tests/adapters/test_verl_shards.py."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("verl.utils.fsdp_utils", reason="verl does not import")

from peft import IA3Config, LoraConfig, get_peft_model  # noqa: E402

from fastsync import ConfigError, renamed_shard_layout, shard_views  # noqa: E402
from fastsync_verl.lora_merge import MergedShards, lora_refusal  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _llama(seed: int = 0) -> torch.nn.Module:
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=40, intermediate_size=75, num_hidden_layers=1,
                                   num_attention_heads=5, num_key_value_heads=1, head_dim=8)
    return transformers.LlamaForCausalLM(cfg)


def _random_b(pm: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if ".lora_B." in n:
                p.normal_(0.0, 0.5)
    return pm


def _landed(pm: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What one trainer rank (world 1) copies into its registered sources, by verl's names."""
    shards = MergedShards(pm, 0, 1)
    layout, local = renamed_shard_layout(shards, 0, 1, shards.hf_names(), description="test")
    _, sources = shard_views(layout, 0)
    shards.copy_local(local, sources)
    return sources


@pytest.mark.parametrize("rslora", [False, True])
def test_merge_equals_peft_merge_and_unload(rslora: bool) -> None:
    pm = _random_b(get_peft_model(_llama(), LoraConfig(r=8, lora_alpha=12, target_modules=TARGETS,
                                                       use_rslora=rslora)))
    want = copy.deepcopy(pm).merge_and_unload().state_dict()
    got = _landed(pm)
    assert list(got) == list(want)
    for n, t in got.items():
        assert torch.equal(t, want[n]), n
    scale = pm.base_model.model.model.layers[0].self_attn.q_proj.scaling["default"]
    assert scale == pytest.approx(12 / 8 ** 0.5 if rslora else 12 / 8)


def test_two_active_adapters_merge_in_order() -> None:
    pm = get_peft_model(_llama(), LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS))
    pm.add_adapter("second", LoraConfig(r=4, lora_alpha=4, target_modules=["q_proj", "down_proj"]))
    pm.base_model.set_adapter(["default", "second"])
    _random_b(pm)
    want = copy.deepcopy(pm).merge_and_unload().state_dict()
    got = _landed(pm)
    for n, t in got.items():
        assert torch.equal(t, want[n]), n


@pytest.mark.parametrize("config, named", [
    (LoraConfig(r=8, target_modules=["q_proj"], use_dora=True), "DoRA (use_dora=True)"),
    (LoraConfig(r=8, target_modules=["q_proj", "embed_tokens"]), "'base_model.model.model.embed_tokens' is a "
                                                                  "peft.tuners.lora.layer.Embedding"),
    (LoraConfig(r=8, target_modules=["q_proj"], modules_to_save=["lm_head"]), "modules_to_save"),
    (IA3Config(target_modules=["q_proj", "down_proj"], feedforward_modules=["down_proj"]), "is IA3, not LoRA"),
])
def test_refusal_names_what_a_local_merge_cannot_stand_for(config, named: str) -> None:
    pm = get_peft_model(_llama(), config)
    why = lora_refusal(pm)
    assert why is not None and named in why, why
    with pytest.raises(ConfigError, match="fastsync trainer rank 3: cannot merge the LoRA adapter shard by shard"):
        MergedShards(pm, 3, 4)


def test_lora_bias_is_refused_naming_the_layer() -> None:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=97, hidden_size=40, intermediate_size=75, num_hidden_layers=1,
                                   num_attention_heads=5, num_key_value_heads=1)
    pm = get_peft_model(transformers.Qwen2ForCausalLM(cfg), LoraConfig(r=8, target_modules=["q_proj"], lora_bias=True))
    why = lora_refusal(pm)
    assert why is not None and "q_proj" in why and "lora_bias=True" in why, why


def test_config_settings_are_refused_by_the_core_rule() -> None:
    """The LoraConfig settings whose merge is not W + scaling * B @ A are fastsync's one rule
    (``fastsync.lora_config_refusal``, also DeepSpeedWeightSync's): layer_replication shares a
    layer between positions of the stack, which a per-shard merge would merge twice."""
    pm = get_peft_model(_llama(), LoraConfig(r=8, target_modules=TARGETS))
    assert lora_refusal(pm) is None
    pm.peft_config["default"].layer_replication = [[0, 1], [0, 1]]
    why = lora_refusal(pm)
    assert why is not None and "LoraConfig.layer_replication=[[0, 1], [0, 1]]" in why, why
