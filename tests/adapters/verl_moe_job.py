"""Run verl's real FSDP engine ``_build_module`` on a tiny saved Qwen3-MoE with and without
``fastsync_verl.moe`` (in its own process: verl's module build applies global monkey patches).
Prints one JSON line: swapped block classes, logits agreement, exported names/shapes."""

from __future__ import annotations

import json
import sys
import tempfile
from types import SimpleNamespace

import torch
from transformers import AutoConfig


def engine(cls, path: str):  # type: ignore[no-untyped-def]
    """A verl engine object with only what ``_build_module`` reads (its __init__ needs a
    distributed job and a GPU; the method under test is verl's own)."""
    e = cls.__new__(cls)
    e.engine_config = SimpleNamespace(model_dtype="fp32", forward_only=False)
    e.model_config = SimpleNamespace(
        hf_config=AutoConfig.from_pretrained(path), model_type="language_model", local_path=path,
        trust_remote_code=False, use_liger=False, fused_kernel_options=None, use_fused_kernels=False,
        enable_gradient_checkpointing=False)
    e.device_mesh = None
    e.use_remove_padding = False
    e.ulysses_sequence_parallel_size = 1
    return e


def main(path: str) -> None:
    from fastsync.moe.presets import ARCH_TINY, build_model

    model = build_model({**ARCH_TINY["qwen3_moe"], "head_dim": 8, "tie_word_embeddings": True}, seed=0)
    model.save_pretrained(path)
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    plain = engine(FSDPEngineWithLMHead, path)._build_module()
    import fastsync_verl.moe  # noqa: F401  (what model.external_lib=fastsync_verl.moe does)

    swapped = engine(FSDPEngineWithLMHead, path)._build_module()
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = plain(input_ids=ids).logits, swapped(input_ids=ids).logits
    from fastsync.moe.block import FastSyncMoEBlock

    sd_a, sd_b = plain.state_dict(), swapped.state_dict()
    print(json.dumps({
        "wrapped": FSDPEngineWithLMHead._build_module.__dict__.get("fastsync_wrapped", False),
        "plain_blocks": [type(m).__name__ for m in plain.modules() if isinstance(m, FastSyncMoEBlock)],
        "swapped_blocks": [n for n, m in swapped.named_modules() if isinstance(m, FastSyncMoEBlock)],
        "max_abs_diff": (a - b).abs().max().item(), "max_abs": a.abs().max().item(),
        "same_state_dict": sorted(sd_a) == sorted(sd_b) and all(sd_a[k].shape == sd_b[k].shape for k in sd_a),
    }))


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as d:
        main(sys.argv[1] if len(sys.argv) > 1 else d)
