"""``fastsync moe-bench``: one MoE block, forward+backward, HF eager vs HF grouped_mm vs fastsync.

What is measured, in order, each variant in its own fresh process (so memory figures do not
mix): build the model's first sparse-MoE block from the config (seeded random weights), one
forward+backward whose output and gradients are kept for the error check, then ``reps`` timed
forward+backward steps (incoming gradient a fixed random, contiguous tensor; parameter
gradients freed between steps). ``tokens_per_s`` = tokens / median step seconds.
HF grouped_mm and fastsync run ``--rounds`` times, alternating, best round reported (the
JSON keeps every round's figure). ``peak_mem_bytes`` = the process's resident-set high-water mark over the timed steps minus its
resident set just before them (Linux: ``/proc/self/clear_refs`` resets ``VmHWM``; torch's CPU
allocator keeps no statistics and tracemalloc does not see it). ``max_abs_err`` = the largest
absolute difference from HF eager over the block output and every gradient (input and parameters).

With ``--ep N`` the fastsync variant runs on N gloo processes, each with tokens/N of the same
batch and 1/N of the experts; its step time is the slowest rank's, its memory figures per rank
(the largest), and ``expert_param_bytes_per_rank`` what each rank holds.
"""

from __future__ import annotations

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
from fastsync.moe.presets import build_config, load_config_dict

__all__ = ["run_bench", "build_block", "variant_job"]

PEAK_MEM_METHOD = "RSS high-water mark (VmHWM reset via /proc/self/clear_refs) minus RSS before the timed steps"


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
    """One variant in this process (rank ``rank`` of ``world`` under EP)."""
    import fastsync.moe as fm

    impl = {"hf_eager": "eager", "hf_grouped_mm": "grouped_mm"}.get(job["variant"], "eager")
    block = build_block(job["config"], impl, job["seed"])
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
    x = x_full[:, rank * per : (rank + 1) * per].clone().requires_grad_(True)
    g = g_full[:, rank * per : (rank + 1) * per].contiguous()

    out = _step(block, x, g)
    result: dict[str, Any] = {"out": out.detach(), "x_grad": x.grad.detach().clone()}
    grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
             for n, p in block.named_parameters()}
    if world > 1:
        shards = {n for n, p in block.named_parameters() if hasattr(p, "_fastsync_ep_shard")}
        for n in grads:
            if n in shards:
                parts = [torch.empty_like(grads[n]) for _ in range(world)]
                dist.all_gather(parts, grads[n].contiguous(), group=group)
                grads[n] = torch.cat(parts, 0)
            else:
                dist.all_reduce(grads[n], group=group)
    result["grads"] = grads

    times: list[float] = []
    cpu_times: list[float] = []
    block.zero_grad(set_to_none=True)
    x.grad = None
    base_kb = _status_kb("VmRSS")
    exact = _reset_peak()
    for _ in range(job["reps"]):
        if world > 1:
            dist.barrier(group=group)
        t0, c0 = time.perf_counter(), time.process_time()
        _step(block, x, g)
        dt = time.perf_counter() - t0
        cpu_times.append(time.process_time() - c0)
        if world > 1:
            t = torch.tensor([dt], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            dt = float(t.item())
        times.append(dt)
        block.zero_grad(set_to_none=True)
        x.grad = None
    peak_kb = _status_kb("VmHWM")
    expert_bytes = sum(p.numel() * p.element_size() for p in block.experts.parameters())
    result.update(
        step_s=statistics.median(times), cpu_s=statistics.median(cpu_times), peak_mem_bytes=max(0, peak_kb - base_kb) * 1024, peak_exact=exact,
        expert_param_bytes=expert_bytes, threads=torch.get_num_threads(),
    )
    return result


def _max_abs_err(res: dict, ref: dict) -> float:
    errs = [(res["out"] - ref["out"]).abs().max().item(), (res["x_grad"] - ref["x_grad"]).abs().max().item()]
    for n, g in ref["grads"].items():
        errs.append((res["grads"][n] - g).abs().max().item())
    return max(errs)


def _cat_ranks(results: list[dict]) -> dict:
    """EP ranks hold consecutive token chunks; rank 0's gradients are already gathered/summed."""
    return {
        "out": torch.cat([r["out"] for r in results], dim=1),
        "x_grad": torch.cat([r["x_grad"] for r in results], dim=1),
        "grads": results[0]["grads"],
    }


def run_bench(
    model: str, tokens: int = 2048, ep: int = 1, reps: int = 3, backend: str = "auto", seed: int = 0,
    timeout_s: float = 900.0, threads: int | None = None, rounds: int = 2,
) -> dict[str, Any]:
    """Run the variants; the JSON-able report (``baselines``, ``fastsync``, ...).

    HF eager runs once (it is the reference and far slower); HF grouped_mm and fastsync run
    ``rounds`` times, alternating, each round a fresh process, and the faster round of each is
    reported (on a shared machine the load drifts over minutes; alternating keeps it fair).
    """
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
    cfg = load_config_dict(model)
    threads = threads or os.cpu_count() or 1
    load_before = os.getloadavg()[0]
    job = {"fn": "fastsync.bench.moe:variant_job", "config": cfg, "tokens": tokens, "reps": reps, "seed": seed,
           "backend": backend}

    def one(variant: str) -> list[dict]:
        if variant == "fastsync":  # under EP the processes share the threads: N processes x threads/N
            return spawn_ep({**job, "variant": variant}, ep, timeout_s=timeout_s, threads=max(1, threads // ep))
        return spawn_ep({**job, "variant": variant}, 1, timeout_s=timeout_s, threads=threads)

    ref = one("hf_eager")[0]
    tries: dict[str, list[list[dict]]] = {"hf_grouped_mm": [], "fastsync": []}
    for _ in range(rounds):
        for variant in tries:
            tries[variant].append(one(variant))

    def entry(ranks: list[dict], all_tries: list[list[dict]] | None = None) -> dict:
        res = _cat_ranks(ranks) if len(ranks) > 1 else ranks[0]
        all_tries = all_tries or [ranks]
        return {
            "tokens_per_s": tokens / ranks[0]["step_s"],
            "step_s": ranks[0]["step_s"],
            "cpu_s_per_step": sum(r["cpu_s"] for r in ranks),
            "peak_mem_bytes": max(r["peak_mem_bytes"] for t in all_tries for r in t),
            "max_abs_err": max(_max_abs_err(_cat_ranks(t) if len(t) > 1 else t[0], ref) for t in all_tries),
            "expert_param_bytes_per_rank": ranks[0]["expert_param_bytes"],
            "threads_per_process": ranks[0]["threads"],
            "tokens_per_s_each_round": [tokens / t[0]["step_s"] for t in all_tries],
        }

    best = {v: min(t, key=lambda ranks: ranks[0]["step_s"]) for v, t in tries.items()}
    eager = entry([ref])
    gmm = entry(best["hf_grouped_mm"], tries["hf_grouped_mm"])
    fast = entry(best["fastsync"], tries["fastsync"])
    fast.update(backend=backend, ep=ep)
    return {
        "model": model,
        "model_type": cfg.get("model_type"),
        "tokens": tokens,
        "reps": reps,
        "rounds": rounds,
        "what": "first sparse-MoE block, forward+backward, fp32, CPU" if not torch.cuda.is_available()
        else "first sparse-MoE block, forward+backward, fp32",
        "threads": threads,
        "load_avg_1min": [load_before, os.getloadavg()[0]],
        "peak_mem_method": PEAK_MEM_METHOD if all(r.get("peak_exact") for r in best["fastsync"]) else
        "RSS high-water mark delta (VmHWM could not be reset: an upper bound including setup)",
        "baselines": {"hf_eager": eager, "hf_grouped_mm": gmm},
        "fastsync": fast,
        "speedup_vs_hf_eager": fast["tokens_per_s"] / eager["tokens_per_s"],
        "speedup_vs_hf_grouped_mm": fast["tokens_per_s"] / gmm["tokens_per_s"],
    }
