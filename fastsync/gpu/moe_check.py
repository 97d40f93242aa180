"""GPU check part ``moe``: one Qwen3-30B-A3B MoE block at its real shapes, bf16, forward+backward.

The published shapes (128 experts, top-8, hidden 2048, expert intermediate 768: 604 M expert
parameters, 1.2 GB in bf16), seeded random weights drawn on the device (the block class
``fastsync moe-bench`` builds, materialised from the meta device), run in one process, one variant at a time: HF eager
(per-expert loop), HF ``grouped_mm`` (transformers v5's default kernel) and fastsync
(``fastsync.moe.patch``, backend ``auto``). Per variant: one step kept for the error check, two
warm-up steps, then ``reps`` timed steps (device synchronised around each; median reported).

* ``tokens_per_s`` = tokens / median step seconds.
* ``peak_mem_bytes`` = ``torch.cuda.max_memory_allocated()`` over the timed steps minus the
  memory allocated just before them (activations, gradients, workspaces: what the variant
  adds on top of its parameters and inputs); ``peak_mem_total_bytes`` the raw high-water mark.
* ``max_abs_err`` / ``max_rel_err`` vs HF eager over the output, the input gradient and every
  parameter gradient (rel: per tensor, max |diff| / max |eager|). bf16 runs differ in summation
  order, so the bf16 check allows 5e-2 relative; a second, fp32 pass at ``--fp32-tokens``
  checks equivalence tightly (1e-3; TF32 off).

``--device cpu --preset tiny-qwen3-moe --dtype float32`` runs the same code on a CPU (tests).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fastsync.bench.moe import compare

__all__ = ["QWEN3_30B_A3B", "run_variant", "compare", "run_moe", "main"]

#: Qwen3-30B-A3B's config.json, one layer (the block is all that is built)
QWEN3_30B_A3B: dict[str, Any] = dict(
    model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
    num_hidden_layers=1, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
    num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=1024, max_position_embeddings=4096,
)
VARIANTS = ("hf_eager", "hf_grouped_mm", "fastsync")
BF16_REL_TOL = 5e-2
FP32_REL_TOL = 1e-3


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _block_on(cfg_dict: dict, impl: str, device: torch.device, dtype: torch.dtype, seed: int) -> nn.Module:
    """The config's first sparse-MoE block built on the meta device and materialised on ``device``
    with seeded N(0, 0.02) weights drawn there: at the real shapes a CPU build and fill (what
    ``fastsync.bench.moe.build_block`` does) costs seconds per variant. Same (config, seed,
    device) -> same weights for every variant. Blocks with buffers (DeepSeek's correction bias)
    take the CPU path, which knows how to fill them."""
    import importlib

    from fastsync.errors import ConfigError
    from fastsync.moe.block import is_moe_block
    from fastsync.moe.presets import build_config

    cfg = build_config(cfg_dict)
    cfg._experts_implementation = impl
    mod = importlib.import_module(f"transformers.models.{cfg.model_type}.modeling_{cfg.model_type}")
    layer_cls = [v for k, v in vars(mod).items() if isinstance(v, type) and k.endswith("DecoderLayer")]
    if not layer_cls:
        raise ConfigError(f"model_type {cfg.model_type!r}: no decoder layer class in {mod.__name__}")
    block = None
    for i in range(cfg.num_hidden_layers):
        with torch.device("meta"):
            layer = layer_cls[0](cfg, i)
        if is_moe_block(getattr(layer, "mlp", None)):
            block = layer.mlp
            break
    if block is None:
        raise ConfigError(f"model_type {cfg.model_type!r}: no sparse-MoE layer among {cfg.num_hidden_layers}")
    if any(True for _ in block.buffers()):
        from fastsync.bench.moe import build_block

        return build_block(cfg_dict, impl, seed).to(device=device, dtype=dtype)
    block = block.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for _, p in block.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32).mul_(0.02))
    return block.to(dtype=dtype)


def _build(variant: str, cfg: dict, device: torch.device, dtype: torch.dtype, seed: int) -> nn.Module:
    import fastsync.moe as fm

    impl = {"hf_eager": "eager", "hf_grouped_mm": "grouped_mm"}.get(variant, "eager")
    block = _block_on(cfg, impl, device, dtype, seed)
    if variant == "fastsync":
        holder = nn.Module()
        holder.mlp = block
        fm.patch(holder, backend="auto")
        block = holder.mlp
    return block


def _step(block: nn.Module, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    out = block(x)
    if isinstance(out, tuple):  # some blocks return (hidden, router logits)
        out = out[0]
    out.backward(g)
    return out


def _grads(block: nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
            for n, p in block.named_parameters()}


def run_variant(variant: str, cfg: dict, *, tokens: int, reps: int, device: torch.device, dtype: torch.dtype,
                seed: int = 0) -> tuple[dict[str, Any], dict[str, Any]]:
    """(figures, first step's outputs and gradients) of one variant."""
    block = _build(variant, cfg, device, dtype, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(1, tokens, cfg["hidden_size"], generator=gen).to(device=device, dtype=dtype).requires_grad_(True)
    g = torch.randn(1, tokens, cfg["hidden_size"], generator=gen).to(device=device, dtype=dtype)
    out = _step(block, x, g)
    first = {"out": out.detach(), "x_grad": x.grad.detach().clone(), "grads": _grads(block)}
    del out
    times: list[float] = []
    peak = base = 0
    for i in range(reps + 2 if reps else 0):
        block.zero_grad(set_to_none=True)
        x.grad = None
        _sync(device)
        if i == 2:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
                base = torch.cuda.memory_allocated(device)
        t0 = time.perf_counter()
        _step(block, x, g)
        _sync(device)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    if times and device.type == "cuda":
        peak = torch.cuda.max_memory_allocated(device)
    experts = getattr(block, "experts", None)
    fig: dict[str, Any] = {
        # fastsync's chosen kernel; HF's experts_implementation as requested
        "kernel": getattr(experts, "kernel", None) or {"hf_eager": "eager", "hf_grouped_mm": "grouped_mm"}.get(variant),
        "param_bytes": sum(p.numel() * p.element_size() for p in block.parameters()),
    }
    if times:
        step_s = statistics.median(times)
        fig.update(step_s=step_s, step_s_all=times, tokens_per_s=tokens / step_s,
                   peak_mem_bytes=max(0, peak - base) if device.type == "cuda" else None,
                   peak_mem_total_bytes=peak if device.type == "cuda" else None)
    del block, x, g
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return fig, first


def run_moe(cfg: dict, *, tokens: int, reps: int, device: torch.device, dtype: torch.dtype, tol: float,
            on_variant: Any = None, informational: tuple[str, ...] = ()) -> dict[str, Any]:
    """All three variants at one dtype; eager first (the reference). A failure of a variant in
    ``informational`` is reported under ``notes`` and does not fail the pass."""
    out: dict[str, Any] = {"dtype": str(dtype).removeprefix("torch."), "tokens": tokens, "reps": reps, "rel_tol": tol}
    ref = None
    errors: list[str] = []
    notes: list[str] = []
    for v in VARIANTS:
        failures = notes if v in informational else errors
        try:
            fig, first = run_variant(v, cfg, tokens=tokens, reps=reps, device=device, dtype=dtype)
            if ref is None:
                ref = first
            else:
                fig.update(compare(first, ref))
                if fig.get("error") or fig["max_rel_err"] is None or fig["max_rel_err"] > tol:
                    failures.append(f"{v}: differs from hf_eager (max rel err {fig.get('max_rel_err')}, "
                                  f"{fig.get('worst_tensor') or fig.get('error')})")
            del first
        except Exception as e:  # the other variants' figures still count
            fig = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
            failures.append(f"{v}: {fig['error']}")
        out[v] = fig
        if on_variant is not None:
            on_variant(out)
    fast, gmm, eager = out.get("fastsync", {}), out.get("hf_grouped_mm", {}), out.get("hf_eager", {})
    if fast.get("tokens_per_s") and gmm.get("tokens_per_s"):
        out["speedup_vs_hf_grouped_mm"] = fast["tokens_per_s"] / gmm["tokens_per_s"]
    if fast.get("tokens_per_s") and eager.get("tokens_per_s"):
        out["speedup_vs_hf_eager"] = fast["tokens_per_s"] / eager["tokens_per_s"]
    if fast.get("peak_mem_bytes") and gmm.get("peak_mem_bytes"):
        out["peak_mem_ratio_vs_hf_grouped_mm"] = fast["peak_mem_bytes"] / gmm["peak_mem_bytes"]
    if fast.get("peak_mem_bytes") and eager.get("peak_mem_bytes"):
        out["peak_mem_ratio_vs_hf_eager"] = fast["peak_mem_bytes"] / eager["peak_mem_bytes"]
    out["errors"] = errors
    out["notes"] = notes
    out["ok"] = not errors
    return out


def main(argv: list[str] | None = None) -> int:
    from fastsync.moe.presets import load_config_dict

    ap = argparse.ArgumentParser(description="GPU check part 'moe'")
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--preset", default="qwen3-30b-a3b-full",
                    help="qwen3-30b-a3b-full (the real shapes) or any fastsync moe preset")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--fp32-tokens", type=int, default=1024, help="tokens of the fp32 equivalence pass (0: skip)")
    args = ap.parse_args(argv)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cfg = dict(QWEN3_30B_A3B) if args.preset == "qwen3-30b-a3b-full" else load_config_dict(args.preset)
    device = torch.device(args.device)
    out_path = Path(args.out)
    result: dict[str, Any] = {"ok": False, "error": None, "preset": args.preset, "config": cfg,
                              "what": "first sparse-MoE block, forward+backward, one process, variants in turn"}

    def save(_: Any = None) -> None:
        out_path.write_text(json.dumps(result, indent=2, default=str))

    def part(key: str, dtype: torch.dtype, tokens: int, reps: int, tol: float, informational: tuple = ()) -> None:
        result[key] = {}
        result[key] = run_moe(cfg, tokens=tokens, reps=reps, device=device, dtype=dtype, tol=tol,
                              on_variant=lambda o: (result.__setitem__(key, o), save()), informational=informational)
        print(f"[moe] {key}: " + json.dumps({k: v for k, v in result[key].items()
                                             if not isinstance(v, dict)}, default=str)[:800], flush=True)
        save()

    part("main", getattr(torch, args.dtype), args.tokens, args.reps,
         BF16_REL_TOL if args.dtype in ("bfloat16", "float16") else FP32_REL_TOL)
    # the headline keys at the top level, as `fastsync moe-bench --json` names them
    for k in ("speedup_vs_hf_grouped_mm", "speedup_vs_hf_eager", "peak_mem_ratio_vs_hf_grouped_mm"):
        result[k] = result["main"].get(k)
    if args.fp32_tokens > 0:
        # HF's own grouped_mm kernel may not take fp32 on CUDA: its result there is a note only
        part("fp32_equivalence", torch.float32, args.fp32_tokens, 0, FP32_REL_TOL, informational=("hf_grouped_mm",))
    errs = result["main"]["errors"] + [f"fp32: {e}" for e in result.get("fp32_equivalence", {}).get("errors", [])]
    result["error"] = "; ".join(errs) or None
    result["ok"] = not errs
    save()
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
