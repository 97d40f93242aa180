"""Inventories equal the real transformers-v5 models' state_dict() names and shapes (meta device)."""

from __future__ import annotations

import json
import time

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from fastsync.errors import ConfigError  # noqa: E402
from fastsync.models import PRESETS, inventory_from_config, load_inventory  # noqa: E402

TINY = {
    "qwen3": ("Qwen3Config", dict(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=32)),
    "qwen3-tied": ("Qwen3Config", dict(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                       tie_word_embeddings=True)),
    "qwen3-moe": ("Qwen3MoeConfig", dict(vocab_size=96, hidden_size=64, intermediate_size=80,
                                         moe_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
                                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                         head_dim=32, decoder_sparse_step=2, mlp_only_layers=[3])),
    "mixtral": ("MixtralConfig", dict(vocab_size=96, hidden_size=64, intermediate_size=80, num_local_experts=4,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)),
    "llama-bias": ("LlamaConfig", dict(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=1, attention_bias=True)),
    "deepseek-v3": ("DeepseekV3Config", dict(vocab_size=96, hidden_size=64, intermediate_size=80,
                                             moe_intermediate_size=32, n_routed_experts=6, n_shared_experts=2,
                                             num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4,
                                             num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=32,
                                             qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=24, n_group=1,
                                             topk_group=1, num_experts_per_tok=2)),
    "deepseek-v3-no-q-lora": ("DeepseekV3Config", dict(vocab_size=96, hidden_size=64, intermediate_size=80,
                                                       moe_intermediate_size=32, n_routed_experts=4,
                                                       n_shared_experts=1, num_hidden_layers=2,
                                                       first_k_dense_replace=1, num_attention_heads=4,
                                                       num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32,
                                                       qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
                                                       n_group=1, topk_group=1, num_experts_per_tok=2)),
}


def _hf(kind: str):
    cls, kw = TINY[kind]
    cfg = getattr(transformers, cls)(**kw)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    return cfg, model


@pytest.mark.parametrize("kind", sorted(TINY))
def test_inventory_equals_real_state_dict(kind):
    cfg, model = _hf(kind)
    real = [(n, tuple(t.shape)) for n, t in model.state_dict().items()]
    inv = inventory_from_config(cfg.to_dict(), name=kind)
    assert inv.architecture == type(model).__name__
    assert [(n, p.shape) for n, p in inv.params.items()] == real


def test_v5_fuses_experts_as_documented():
    _, model = _hf("qwen3-moe")
    sd = model.state_dict()
    assert tuple(sd["model.layers.1.mlp.experts.gate_up_proj"].shape) == (8, 2 * 48, 64)  # [E, 2I, H]
    assert tuple(sd["model.layers.1.mlp.experts.down_proj"].shape) == (8, 64, 48)  # [E, H, I]
    assert "model.layers.0.mlp.gate_proj.weight" in sd  # decoder_sparse_step=2: layer 0 is dense
    assert "model.layers.3.mlp.gate_proj.weight" in sd  # mlp_only_layers=[3]


def test_local_directory_with_saved_config(tmp_path):
    cfg, model = _hf("deepseek-v3")
    cfg.save_pretrained(tmp_path)
    inv = load_inventory(str(tmp_path))
    assert [(n, p.shape) for n, p in inv.params.items()] == [(n, tuple(t.shape)) for n, t in model.state_dict().items()]
    assert inv.name == str(tmp_path)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_load_and_match_published_sizes(name):
    inv = load_inventory(name)
    billions = inv.num_params / 1e9
    expected = {"qwen3-30b-a3b": 30.5, "qwen3-235b-a22b": 235.1, "deepseek-v3": 671.0, "kimi-k2": 1026.4,
                "qwen3-0.6b": 0.75, "qwen3-8b": 8.2, "llama-3-8b": 8.03, "mixtral-8x7b": 46.7}[name]
    # Published totals (HF model cards); qwen3-0.6b counts its tied lm_head twice, as state_dict() does.
    assert abs(billions - expected) / expected < 0.01, billions
    assert all(p.dtype == "bfloat16" for p in inv.params.values())


def test_kimi_k2_shapes_and_speed():
    t0 = time.perf_counter()
    inv = load_inventory("kimi-k2")
    elapsed = time.perf_counter() - t0
    p = inv.params
    assert inv.architecture == "DeepseekV3ForCausalLM"
    assert p["model.embed_tokens.weight"].shape == (163840, 7168)
    assert p["model.layers.0.mlp.gate_proj.weight"].shape == (18432, 7168)  # first_k_dense_replace=1
    assert p["model.layers.1.mlp.experts.gate_up_proj"].shape == (384, 4096, 7168)
    assert p["model.layers.60.mlp.experts.down_proj"].shape == (384, 7168, 2048)
    assert p["model.layers.1.mlp.shared_experts.up_proj.weight"].shape == (2048, 7168)
    assert p["model.layers.1.self_attn.q_b_proj.weight"].shape == (64 * 192, 1536)
    assert "model.layers.61.input_layernorm.weight" not in p
    assert elapsed < 5.0  # generous bound on a loaded 2-core box; the benchmark reports the real figure


def test_dtype_override():
    inv = load_inventory("qwen3-0.6b", dtype="float32")
    assert {p.dtype for p in inv.params.values()} == {"float32"}


def test_unknown_preset_names_it_and_lists_known():
    with pytest.raises(ConfigError, match=r"'no-such-model'.*kimi-k2"):
        load_inventory("no-such-model")


def test_directory_without_config_json(tmp_path):
    with pytest.raises(ConfigError, match=r"has no config.json.*qwen3-30b-a3b"):
        load_inventory(str(tmp_path))


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "n_embd": 8}))
    with pytest.raises(ConfigError, match=r"unsupported architecture 'GPT2LMHeadModel'.*Qwen3MoeForCausalLM"):
        load_inventory(str(tmp_path))


def test_missing_key_is_named():
    cfg = dict(PRESETS["qwen3-8b"])
    del cfg["hidden_size"]
    with pytest.raises(ConfigError, match="'hidden_size'"):
        inventory_from_config(cfg)
