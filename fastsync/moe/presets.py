"""Scaled-down MoE configs for ``fastsync moe-bench`` and tests (HF ``config.json`` dicts).

The ``*-scaled`` presets keep the published expert count and top-k (the ratios that set the
dispatch pattern and GEMM sizes per expert) and shrink hidden / intermediate sizes by the same
factor so a forward+backward fits this project's 2-core CPU. ``tiny-*`` presets are for tests.
Nothing is downloaded.
"""

from __future__ import annotations

import os
from typing import Any

from fastsync.errors import ConfigError

__all__ = ["PRESETS", "load_config_dict", "build_config", "build_model", "ARCH_TINY"]

_ATTN_TINY = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=64, max_position_embeddings=64)

#: tiny configs, one per supported architecture (random weights in tests)
ARCH_TINY: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(
        model_type="qwen3_moe", hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, **_ATTN_TINY,
    ),
    "qwen2_moe": dict(
        model_type="qwen2_moe", hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, shared_expert_intermediate_size=32, **_ATTN_TINY,
    ),
    "mixtral": dict(
        model_type="mixtral", hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_local_experts=8,
        num_experts_per_tok=2, **_ATTN_TINY,
    ),
    "deepseek_v3": dict(
        model_type="deepseek_v3", hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
        first_k_dense_replace=1, routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, num_attention_heads=4, num_key_value_heads=4, vocab_size=64,
        max_position_embeddings=64,
    ),
    "gpt_oss": dict(
        model_type="gpt_oss", hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_local_experts=8,
        num_experts_per_tok=2, sliding_window=16, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **_ATTN_TINY,
    ),
}

PRESETS: dict[str, dict[str, Any]] = {
    # Qwen3-30B-A3B: 128 experts, top-8, hidden 2048, moe_intermediate 768 -> /4
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe", hidden_size=512, intermediate_size=1536, moe_intermediate_size=192,
        num_hidden_layers=1, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
        num_attention_heads=8, num_key_value_heads=4, head_dim=64, vocab_size=1024,
    ),
    # Mixtral-8x7B: 8 experts, top-2, hidden 4096, intermediate 14336 -> /8
    "mixtral-8x7b": dict(
        model_type="mixtral", hidden_size=512, intermediate_size=1792, num_hidden_layers=1, num_local_experts=8,
        num_experts_per_tok=2, num_attention_heads=8, num_key_value_heads=4, head_dim=64, vocab_size=1024,
    ),
    # DeepSeek-V3: 256 experts, top-8, 8 groups / top-4 groups, 1 shared expert, hidden 7168, moe 2048 -> /14, /8
    "deepseek-v3": dict(
        model_type="deepseek_v3", hidden_size=512, intermediate_size=1024, moe_intermediate_size=256,
        num_hidden_layers=1, n_routed_experts=256, num_experts_per_tok=8, n_group=8, topk_group=4,
        n_shared_experts=1, first_k_dense_replace=0, kv_lora_rank=64, q_lora_rank=96, qk_rope_head_dim=16,
        qk_nope_head_dim=32, v_head_dim=32, num_attention_heads=8, num_key_value_heads=8, vocab_size=1024,
    ),
    # GPT-OSS-20B: 32 experts, top-4, hidden 2880, intermediate 2880 -> /6 (rounded to 480)
    "gpt-oss-20b": dict(
        model_type="gpt_oss", hidden_size=480, intermediate_size=480, num_hidden_layers=1, num_local_experts=32,
        num_experts_per_tok=4, num_attention_heads=8, num_key_value_heads=4, head_dim=64, vocab_size=1024,
        layer_types=["full_attention"], rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    **{f"tiny-{k.replace('_', '-')}": v for k, v in ARCH_TINY.items()},
}


def load_config_dict(model: str) -> dict[str, Any]:
    """A preset name, or a directory holding an HF ``config.json`` (used as given)."""
    if model in PRESETS:
        return dict(PRESETS[model])
    path = os.path.join(model, "config.json") if os.path.isdir(model) else model
    if os.path.isfile(path):
        from fastsync.layout.config_json import read_config_json

        return read_config_json(path)
    raise ConfigError(f"--model {model!r}: not a preset ({', '.join(sorted(PRESETS))}) nor an HF config dir")


def build_config(d: dict[str, Any]) -> Any:
    """An HF config object from a config dict (needs ``model_type``)."""
    from transformers import AutoConfig

    d = dict(d)
    model_type = d.pop("model_type", None)
    if model_type is None:
        raise ConfigError("config has no 'model_type'")
    for k in ("architectures", "transformers_version", "torch_dtype", "dtype"):
        d.pop(k, None)
    return AutoConfig.for_model(model_type, **d)


def build_model(d: dict[str, Any], seed: int = 0, *, experts_implementation: str = "eager") -> Any:
    """A causal LM from config dict ``d`` with seeded random weights (std 0.3 for matrices, so
    routing is far from ties; norms near 1; DeepSeek's ``e_score_correction_bias`` non-zero),
    fp32, eager attention. The same (d, seed) gives the same weights in every process."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = build_config(d)
    cfg.output_router_logits = True
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        cfg, attn_implementation="eager", experts_implementation=experts_implementation
    )
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.dim() >= 2 else 0.1))
            if "norm" in name and p.dim() == 1:
                p.add_(1.0)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.1)
    return model.float()
