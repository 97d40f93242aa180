"""``fastsync moe-bench``: one MoE block, forward+backward, HF eager vs HF grouped_mm vs fastsync.

What is measured, in order, each variant in its own fresh process (so memory figures do not
mix): build the model's first sparse-MoE block from the config (seeded random weights, ``dtype``)
and its input; one step on a few tokens (one-time library costs); read the resident set; reset the resident-set high-water mark; one untimed
warm-up step, then ``reps`` timed forward+backward steps (incoming gradient a fixed random,
contiguous tensor; parameter gradients freed between steps); read the high-water mark; last, one
more step whose output and gradients are kept for the error check.

Every variant runs ``rounds`` times, the three alternating (eager, grouped_mm, fastsync, eager,
...), each round a fresh process, so every variant gets the same number of timed steps
(``rounds * reps``) under the same drift of a shared machine's load. The same statistics for all:

* ``tokens_per_s`` = tokens / ``step_s``; ``step_s`` = the median of all ``rounds * reps`` timed
  steps, ``step_s_min`` / ``step_s_max`` beside it, ``tokens_per_s_each_round`` from each round's
  median.
* ``peak_mem_bytes`` = the median over rounds of (the process's resident-set high-water mark over
  warm-up and timed steps minus its resident set just before them): what a forward+backward adds
  on top of the parameters, the input and the imports (activations kept for backward, gradients,
  workspaces). Linux ``/proc/self/clear_refs`` resets ``VmHWM``; torch's CPU allocator keeps no
  statistics and tracemalloc does not see it. The first step is inside the window on purpose:
  glibc keeps freed memory for reuse, so a window opened after a step would miss what that step
  left cached. ``peak_mem_ratio_vs_stock`` = that figure over stock Transformers v5's
  (``hf_grouped_mm``, v5's default experts kernel).
* ``max_rel_err`` = per tensor, max |variant - HF eager| / max |HF eager|, the worst over the
  block output, the input gradient and every parameter gradient, and over rounds (HF eager's
  own later rounds are checked against its first: it is deterministic). Over ``REL_TOL[dtype]``
  is a mismatch: the report lists it under ``mismatches`` and the command exits 1.

With ``--ep N`` the fastsync variant runs on N gloo processes, each with tokens/N of the same
batch and 1/N of the experts; its step time is the slowest rank's, its memory figures per rank
(the largest), and ``expert_param_bytes_per_rank`` what each rank holds.
"""

from __future__ import annotations

import gc
import importlib
import os
import re
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fastsync.errors import ConfigError
from fastsync.moe.block import is_moe_block
from fastsync.moe.ep_run import spawn_ep
from fastsync.moe.patch import ep_shards
from fastsync.moe.presets import build_config, load_config_dict

__all__ = ["run_bench", "build_block", "variant_job", "compare", "REL_TOL", "VARIANTS", "MEMORY_GOAL"]

VARIANTS = ("hf_eager", "hf_grouped_mm", "fastsync")
#: the variant that stands for stock Transformers v5 (its default experts kernel)
STOCK = "hf_grouped_mm"
#: largest allowed ``max_rel_err`` against HF eager, per dtype: fp32 GEMMs on a CPU differ only in
#: summation order (measured below 1e-5); bf16 rounds every intermediate to 8 bits of mantissa
#: (the GPU check allows the same 5e-2 for bf16)
REL_TOL: dict[str, float] = {"float32": 1e-4, "bfloat16": 5e-2}
MEMORY_GOAL = "about 30% less peak memory than stock Transformers v5, on GPU (ratio <= 0.7)"
MEMORY_GOAL_RATIO = 0.7
PEAK_MEM_METHOD = ("per variant, in its own fresh process: resident-set high-water mark (VmHWM, reset through "
                   "/proc/self/clear_refs) over the warm-up and timed steps minus the resident set just before "
                   "them; median over rounds")
CPU_MEMORY_NOTE = (
    "A CPU figure tells how much memory each variant's own tensors need for a forward+backward (activations "
    "saved for backward, permutation and grouping buffers, gradients) at these scaled-down shapes in this dtype; "
    "it does not tell the GPU figure: CUDA's caching allocator rounds and caches blocks, GPU kernels bring their "
    "own workspaces (cuBLAS, grouped GEMM), glibc keeps freed pages resident where CUDA would reuse them, and "
    "only pages actually touched count in a resident set. The GPU figure is torch.cuda.max_memory_allocated "
    "at the real shapes in bf16: `make gpu-check`, part moe."
)


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        m = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE)
    return int(m.group(1)) if m else 0


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def build_block(cfg_dict: dict[str, Any], experts_implementation: str, seed: int) -> nn.Module:
    """The first sparse-MoE block of the config's model, seeded random weights (std 0.02 like
    HF init, DeepSeek's correction bias non-zero)."""
    cfg = build_config(cfg_dict)
    cfg._experts_implementation = experts_implementation
    mod = importlib.import_module(f"transformers.models.{cfg.model_type}.modeling_{cfg.model_type}")
    layer_cls = [v for k, v in vars(mod).items() if isinstance(v, type) and k.endswith("DecoderLayer")]
    if not layer_cls:
        raise ConfigError(f"model_type {cfg.model_type!r}: no decoder layer class in {mod.__name__}")
    for i in range(cfg.num_hidden_layers):
        torch.manual_seed(seed)
        layer = layer_cls[0](cfg, i)
        block = getattr(layer, "mlp", None)
        if block is not None and is_moe_block(block):
            break
    else:
        raise ConfigError(f"model_type {cfg.model_type!r}: no sparse-MoE layer among {cfg.num_hidden_layers}")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in block.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
        for name, b in block.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.01)
    return block.float()


def _step(block: nn.Module, x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    out = block(x)
    if isinstance(out, tuple):  # GPT-OSS returns (hidden, router_scores)
        out = out[0]
    out.backward(g)
    return out


def variant_job(job: dict, rank: int, world: int, group: Any) -> dict:
    """One variant in this process (rank ``rank`` of ``world`` under EP): memory and time first,
    from a fresh process, then the step kept for the error check."""
    import fastsync.moe as fm

    dtype = getattr(torch, job.get("dtype", "float32"))
    impl = {"hf_eager": "eager", "hf_grouped_mm": "grouped_mm"}.get(job["variant"], "eager")
    block = build_block(job["config"], impl, job["seed"]).to(dtype)
    if job["variant"] == "fastsync":
        holder = nn.Module()
        holder.mlp = block
        fm.patch(holder, ep_group=group if world > 1 else None, backend=job["backend"])
        block = holder.mlp
    hidden = block.experts.gate_up_proj.shape[-1 if not getattr(block.experts, "is_transposed", False) else 1]
    gen = torch.Generator().manual_seed(job["seed"] + 1)
    x_full = torch.randn(1, job["tokens"], hidden, generator=gen)
    g_full = torch.randn(1, job["tokens"], hidden, generator=gen)
    per = job["tokens"] // world
    x = x_full[:, rank * per : (rank + 1) * per].to(dtype, copy=True).requires_grad_(True)
    g = g_full[:, rank * per : (rank + 1) * per].to(dtype, copy=True)
    del x_full, g_full

    # one-time costs (lazy library init, thread pools) outside the memory window: one step on a
    # few tokens, so that little of what it frees stays cached for the window to miss
    few = min(8, per)
    x_few = x[:, :few].detach().clone().requires_grad_(True)
    _step(block, x_few, g[:, :few].contiguous())
    block.zero_grad(set_to_none=True)
    del x_few

    times: list[float] = []
    cpu_times: list[float] = []
    gc.collect()
    if world > 1:
        dist.barrier(group=group)
    base_kb = _status_kb("VmRSS")
    exact = _reset_peak()
    for i in range(job["reps"] + 1):  # step 0: warm-up, inside the memory window, not timed
        if world > 1:
            dist.barrier(group=group)
        t0, c0 = time.perf_counter(), time.process_time()
        _step(block, x, g)
        dt = time.perf_counter() - t0
        dc = time.process_time() - c0
        block.zero_grad(set_to_none=True)
        x.grad = None
        if world > 1:
            t = torch.tensor([dt], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            dt = float(t.item())
        if i:
            times.append(dt)
            cpu_times.append(dc)
    peak_kb = _status_kb("VmHWM")

    out = _step(block, x, g)
    result: dict[str, Any] = {"out": out.detach().float(), "x_grad": x.grad.detach().float()}
    grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
             for n, p in block.named_parameters()}
    if world > 1:
        shards = set(ep_shards(block))
        for n in grads:
            if n in shards:
                parts = [torch.empty_like(grads[n]) for _ in range(world)]
                dist.all_gather(parts, grads[n].contiguous(), group=group)
                grads[n] = torch.cat(parts, 0)
            else:
                dist.all_reduce(grads[n], group=group)
    result["grads"] = {n: t.float() for n, t in grads.items()}
    bump = (job.get("perturb") or {}).get(job["variant"])
    if bump:  # test-only fault hook: a numeric mismatch of relative size ``bump`` in the output
        result["out"].view(-1)[0] += bump * result["out"].abs().max()

    expert_bytes = sum(p.numel() * p.element_size() for p in block.experts.parameters())
    result.update(
        step_s_all=times, cpu_s=statistics.median(cpu_times), peak_mem_bytes=max(0, peak_kb - base_kb) * 1024,
        peak_exact=exact, expert_param_bytes=expert_bytes, threads=torch.get_num_threads(),
    )
    return result


def compare(got: dict, ref: dict) -> dict[str, Any]:
    """Max abs and max relative (per tensor, vs the reference's max magnitude) differences over the
    output, the input gradient and every parameter gradient; ``worst_tensor`` names the worst."""
    pairs = [("out", got["out"], ref["out"]), ("x_grad", got["x_grad"], ref["x_grad"])]
    missing = sorted(set(ref["grads"]) - set(got["grads"]))
    pairs += [(f"grad:{n}", got["grads"][n], g) for n, g in ref["grads"].items() if n in got["grads"]]
    worst_abs, worst_rel, worst = 0.0, 0.0, None
    for name, a, b in pairs:
        if a.shape != b.shape:
            return {"max_abs_err": None, "max_rel_err": None, "error": f"{name}: shape {tuple(a.shape)} vs {tuple(b.shape)}"}
        d = (a.float() - b.float()).abs().max().item() if a.numel() else 0.0
        scale = b.float().abs().max().item() if b.numel() else 0.0
        rel = d / scale if scale > 0 else d
        worst_abs = max(worst_abs, d)
        if rel >= worst_rel:
            worst_rel, worst = rel, name
    out: dict[str, Any] = {"max_abs_err": worst_abs, "max_rel_err": worst_rel,
                           "worst_tensor": worst if worst_rel > 0 else None}
    if missing:
        out["error"] = f"gradients missing for {missing[:3]}"
    return out


def _cat_ranks(results: list[dict]) -> dict:
    """EP ranks hold consecutive token chunks; rank 0's gradients are already gathered/summed."""
    if len(results) == 1:
        return results[0]
    return {
        "out": torch.cat([r["out"] for r in results], dim=1),
        "x_grad": torch.cat([r["x_grad"] for r in results], dim=1),
        "grads": results[0]["grads"],
    }


def run_bench(
    model: str, tokens: int = 2048, ep: int = 1, reps: int = 3, backend: str = "auto", seed: int = 0,
    timeout_s: float = 900.0, threads: int | None = None, rounds: int = 2, dtype: str = "float32",
    perturb: dict[str, float] | None = None,
) -> dict[str, Any]:
    """Run every variant ``rounds`` times, alternating; the JSON-able report (``baselines``,
    ``fastsync``, ``mismatches``, ``ok``, ...). ``perturb`` (tests only) adds a relative error of
    the given size to a variant's output, to prove a mismatch fails the bench."""
    from fastsync.layout.limits import check_count, check_seconds

    check_count("tokens (--tokens)", tokens, hi=1 << 20)
    check_count("ep (--ep)", ep, hi=64)
    check_count("reps (--reps)", reps, hi=1000)
    check_count("rounds (--rounds)", rounds, hi=100)
    if threads is not None:
        check_count("threads (--threads)", threads, hi=4096)
    check_seconds("timeout_s (--timeout)", timeout_s)
    if tokens % ep:
        raise ConfigError(f"--tokens {tokens} must be divisible by --ep {ep}")
    if dtype not in REL_TOL:
        raise ConfigError(f"--dtype {dtype!r}: one of {sorted(REL_TOL)}")
    for v in perturb or {}:
        if v not in VARIANTS:
            raise ConfigError(f"perturb: unknown variant {v!r}; one of {VARIANTS}")
    cfg = load_config_dict(model)
    threads = threads or os.cpu_count() or 1
    load_before = os.getloadavg()[0]
    job = {"fn": "fastsync.bench.moe:variant_job", "config": cfg, "tokens": tokens, "reps": reps, "seed": seed,
           "backend": backend, "dtype": dtype, "perturb": dict(perturb or {})}

    def one(variant: str) -> list[dict]:
        if variant == "fastsync":  # under EP the processes share the threads: N processes x threads/N
            return spawn_ep({**job, "variant": variant}, ep, timeout_s=timeout_s, threads=max(1, threads // ep))
        return spawn_ep({**job, "variant": variant}, 1, timeout_s=timeout_s, threads=threads)

    tries: dict[str, list[list[dict]]] = {v: [] for v in VARIANTS}
    for _ in range(rounds):
        for variant in VARIANTS:
            tries[variant].append(one(variant))
    ref = tries["hf_eager"][0][0]
    tol = REL_TOL[dtype]

    def entry(variant: str) -> dict:
        rounds_ = tries[variant]
        steps = [dt for ranks in rounds_ for dt in ranks[0]["step_s_all"]]
        peaks = [max(r["peak_mem_bytes"] for r in ranks) for ranks in rounds_]
        errs = [compare(_cat_ranks(ranks), ref) for ranks in rounds_]
        worst = max(errs, key=lambda e: float("inf") if e["max_rel_err"] is None else e["max_rel_err"])
        step_s = statistics.median(steps)
        return {
            "rounds": len(rounds_),
            "timed_steps": len(steps),
            "tokens_per_s": tokens / step_s,
            "step_s": step_s,
            "step_s_min": min(steps),
            "step_s_max": max(steps),
            "tokens_per_s_each_round": [tokens / statistics.median(r[0]["step_s_all"]) for r in rounds_],
            "cpu_s_per_step": statistics.median([sum(r["cpu_s"] for r in ranks) for ranks in rounds_]),
            "peak_mem_bytes": int(statistics.median(peaks)),
            "peak_mem_bytes_min": min(peaks),
            "peak_mem_bytes_max": max(peaks),
            "peak_mem_bytes_each_round": peaks,
            "max_abs_err": None if worst["max_rel_err"] is None else max(e["max_abs_err"] for e in errs),
            "max_rel_err": worst["max_rel_err"],
            "worst_tensor": worst.get("worst_tensor"),
            "error": worst.get("error"),
            "rel_tol": tol,
            "expert_param_bytes_per_rank": rounds_[0][0]["expert_param_bytes"],
            "threads_per_process": rounds_[0][0]["threads"],
        }

    rows = {v: entry(v) for v in VARIANTS}
    rows["fastsync"].update(backend=backend, ep=ep)
    mismatches = []
    stock_peak = rows[STOCK]["peak_mem_bytes"]
    for v, r in rows.items():
        r["peak_mem_ratio_vs_stock"] = r["peak_mem_bytes"] / stock_peak if stock_peak else None
        if r["error"] or r["max_rel_err"] is None or r["max_rel_err"] > tol:
            mismatches.append({
                "variant": v, "max_rel_err": r["max_rel_err"], "rel_tol": tol, "worst_tensor": r["worst_tensor"],
                "times_tolerance": None if r["max_rel_err"] is None else r["max_rel_err"] / tol,
                "error": r["error"],
            })
    fast, eager, gmm = rows["fastsync"], rows["hf_eager"], rows["hf_grouped_mm"]
    exact = all(r.get("peak_exact") for ranks in tries["fastsync"] for r in ranks)
    return {
        "model": model,
        "model_type": cfg.get("model_type"),
        "tokens": tokens,
        "reps": reps,
        "rounds": rounds,
        "dtype": dtype,
        "what": f"first sparse-MoE block, forward+backward, {dtype}"
        + (", CPU" if not torch.cuda.is_available() else ""),
        "threads": threads,
        "load_avg_1min": [load_before, os.getloadavg()[0]],
        "statistic": f"median of {rounds} rounds x {reps} timed steps per variant (same for every variant)",
        "peak_mem_method": PEAK_MEM_METHOD if exact else
        "RSS high-water mark delta (VmHWM could not be reset: an upper bound including setup)",
        "peak_mem_stock": STOCK,
        "peak_mem_goal": MEMORY_GOAL,
        "peak_mem_goal_ratio": MEMORY_GOAL_RATIO,
        "peak_mem_device": "cpu",
        "peak_mem_note": CPU_MEMORY_NOTE,
        "rel_tol": dict(REL_TOL),
        "baselines": {"hf_eager": eager, "hf_grouped_mm": gmm},
        "fastsync": fast,
        "speedup_vs_hf_eager": fast["tokens_per_s"] / eager["tokens_per_s"],
        "speedup_vs_hf_grouped_mm": fast["tokens_per_s"] / gmm["tokens_per_s"],
        "peak_mem_ratio_vs_hf_grouped_mm": fast["peak_mem_ratio_vs_stock"],
        "mismatches": mismatches,
        "ok": not mismatches,
    }
