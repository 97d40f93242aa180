"""GPU check part ``sync``: weight sync VRAM -> VRAM on one GPU, three ways, in one run.

1. ``device_copy``: ``torch`` ``copy_`` between two buffers on the device (cudaMemcpyAsync
   device-to-device) of one sync's bytes: the device's own bound for moving them.
2. ``bf16``: ``fastsync bench``'s cluster with every tensor in VRAM: T trainer processes (FSDP
   shards of a Qwen3-MoE-like bf16 model) write into R inference processes (vLLM-like TP shards,
   fused qkv / w13) through the real planner and executor, ``nixl`` (one-sided WRITEs, UCX
   cuda_ipc, staging in VRAM) and ``rank0`` (the baseline: gather on trainer rank 0, broadcast;
   over gloo through host memory, since NCCL refuses two ranks on one GPU) interleaved; the last
   sync of each is verified by per-transfer CRC.
3. ``fp8``: the same with an FP8 engine: the senders quantise bf16 -> block FP8 + scales on
   the GPU while packing, ``nixl`` only.

Writes its JSON after each step, so a deadline that kills it leaves what was measured.
``--device cpu`` runs the same code on the CPU (the tests do, at a small size).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

__all__ = ["device_copy", "sync_run", "main"]


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def device_copy(nbytes: int, device: str = "cuda", reps: int = 10) -> dict[str, Any]:
    """Median-free, event-free: ``reps`` back-to-back copies between two buffers, one sync at the
    end (what the hardware sustains), then the bytes compared."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    a.copy_(torch.arange(nbytes, device=device, dtype=torch.int64).remainder_(251).to(torch.uint8))
    b = torch.zeros_like(a)
    b.copy_(a)  # warm-up
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        b.copy_(a)
    _sync(device)
    secs = (time.perf_counter() - t0) / reps
    verified = bool(torch.equal(a, b))
    del a, b
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return {"bytes": nbytes, "seconds": secs, "gbps": nbytes / secs / 1e9, "verified": verified, "reps": reps,
            "what": f"torch copy_ between two {device} buffers (device-to-device memcpy), mean of {reps}"}


def sync_run(*, size_gb: float, trainers: int, rollouts: int, transports: list[str], steps: int,
             fp8: bool, device: str, timeout_s: float) -> dict[str, Any]:
    """One bench cluster with tensors on ``device``; the per-transport figures."""
    from fastsync.bench.harness import run_bench
    from fastsync.bench.workers import WorkerConfig

    cfg = WorkerConfig(trainers=trainers, rollouts=rollouts, port=0, size_bytes=int(size_gb * (1 << 30)),
                       fp8=fp8, device=device, timeout_s=timeout_s, torch_threads=2)
    res = run_bench(cfg, transports, steps=steps, warmup=1, progress=False)
    out = {k: res[k] for k in ("model", "bytes_per_sync", "num_tensors", "num_transfers", "trainers", "rollouts",
                               "steps", "wall_seconds", "setup_seconds_max")}
    out["device"] = device
    out["transports"] = transports
    for name, r in res["transports"].items():
        out[name] = {k: r[k] for k in ("seconds_median", "seconds_all", "gbps", "verified", "errors",
                                       "stages_trainer", "stages_engine")}
    if "nixl" in out and "rank0" in out and out["nixl"]["seconds_median"] and out["rank0"]["seconds_median"]:
        out["nixl_vs_rank0"] = out["rank0"]["seconds_median"] / out["nixl"]["seconds_median"]
    out["ok"] = all(out[n]["verified"] is True and not out[n]["errors"] for n in transports)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="GPU check part 'sync'")
    ap.add_argument("--out", required=True, help="JSON result path")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--size-gb", type=float, default=4.0, help="bf16 model size (GiB) of the nixl/rank0 run")
    ap.add_argument("--fp8-size-gb", type=float, default=1.0, help="model size of the FP8 run (0: skip)")
    ap.add_argument("--trainers", type=int, default=4)
    ap.add_argument("--rollouts", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3, help="timed syncs per transport (median reported)")
    ap.add_argument("--timeout", type=float, default=60.0, help="deadline of each sync / barrier (s)")
    args = ap.parse_args(argv)
    out_path = Path(args.out)
    from fastsync.transport.nixl import IMPORT_ERROR

    result: dict[str, Any] = {"ok": False, "error": None, "nixl_import_error": None if IMPORT_ERROR is None
                              else f"{type(IMPORT_ERROR).__name__}: {IMPORT_ERROR}"}
    errors: list[str] = []

    def save() -> None:
        result["error"] = "; ".join(errors) or None
        out_path.write_text(json.dumps(result, indent=2, default=str))

    def step(key: str, fn: Any) -> None:
        t0 = time.monotonic()
        try:
            result[key] = fn()
            if not result[key].get("ok", result[key].get("verified")):
                errors.append(f"{key}: not verified")
        except Exception as e:  # one step failing must not cost the others' figures
            result[key] = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
            errors.append(f"{key}: {type(e).__name__}: {e}")
        result[key]["part_seconds"] = round(time.monotonic() - t0, 2)
        print(f"[sync] {key}: {json.dumps({k: v for k, v in result[key].items() if k != 'trace'}, default=str)[:600]}",
              flush=True)
        save()

    have_nixl = IMPORT_ERROR is None
    if not have_nixl:
        errors.append(f"nixl not importable, its parts skipped: {result['nixl_import_error']}")
    transports = (["nixl"] if have_nixl else []) + ["rank0"]
    common = dict(trainers=args.trainers, rollouts=args.rollouts, steps=args.steps, device=args.device,
                  timeout_s=args.timeout)
    step("bf16", lambda: sync_run(size_gb=args.size_gb, transports=transports, fp8=False, **common))
    if "rank0" not in result["bf16"] and have_nixl:
        # the joint run died (a NIXL failure takes the whole cluster down): the baseline alone
        step("bf16_rank0_only", lambda: sync_run(size_gb=args.size_gb, transports=["rank0"], fp8=False, **common))
    nbytes = result["bf16"].get("bytes_per_sync") or int(args.size_gb * (1 << 30))
    step("device_copy", lambda: device_copy(nbytes, args.device))
    bf, copy_gbps = result["bf16"], result["device_copy"].get("gbps")
    rank0 = bf.get("rank0") or result.get("bf16_rank0_only", {}).get("rank0") or {}
    if copy_gbps:
        if bf.get("nixl", {}).get("gbps"):
            bf["nixl_fraction_of_device_copy"] = bf["nixl"]["gbps"] / copy_gbps
        if rank0.get("gbps"):
            bf["rank0_fraction_of_device_copy"] = rank0["gbps"] / copy_gbps
    if have_nixl and args.fp8_size_gb > 0:
        step("fp8", lambda: sync_run(size_gb=args.fp8_size_gb, transports=["nixl"], fp8=True,
                                     **{**common, "trainers": min(args.trainers, 2)}))
    result["ok"] = not errors
    save()
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
