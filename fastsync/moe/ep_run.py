"""Run a job on N expert-parallel processes (gloo on 127.0.0.1; NCCL on N GPUs), with a deadline.

Used by ``fastsync moe-bench --ep N`` and the EP tests. Each process joins a gloo group (NCCL with
``job["dist_backend"] = "nccl"``: rank r on GPU r, for the DeepEP test) through
``tcp://127.0.0.1:<free port>``, runs ``job["fn"]`` (a ``"module:function"`` taking
``(job, rank, world_size, group)`` and returning a picklable dict), and writes the result to
``<out_dir>/rank<r>.pt`` (or its traceback to ``rank<r>.err``). The parent waits at most
``timeout_s`` in all, then terminates whatever is left and raises.
"""

from __future__ import annotations

import importlib
import os
import socket
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Any

import torch

from fastsync.errors import FastSyncError
from fastsync.procs import rank_context

__all__ = ["spawn_ep", "free_port"]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, world: int, port: int, job: dict, out_dir: str, threads: int) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        import torch.distributed as dist

        torch.set_num_threads(threads)
        backend = job.get("dist_backend", "gloo")
        extra: dict[str, Any] = {}
        if backend == "nccl":  # one GPU per rank, as DeepEP's own tests set it up
            torch.cuda.set_device(rank)
            extra["device_id"] = torch.device("cuda", rank)
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
            timeout=timedelta(seconds=float(job.get("collective_timeout_s", 120))), **extra,
        )
        try:
            mod_name, fn_name = job["fn"].split(":")
            fn = getattr(importlib.import_module(mod_name), fn_name)
            result = fn(job, rank, world, dist.group.WORLD)
            torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        finally:
            dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise


def spawn_ep(job: dict[str, Any], world: int, timeout_s: float = 300.0, threads: int = 1) -> list[dict]:
    """Run ``job`` on ``world`` gloo processes; the per-rank result dicts, in rank order."""
    ctx = rank_context()
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="fastsync-ep-") as out_dir:
        procs = [ctx.Process(target=_worker, args=(r, world, port, job, out_dir, threads), daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        try:
            for p in procs:
                p.join(max(0.0, deadline - time.monotonic()))
        finally:
            alive = [p for p in procs if p.is_alive()]
            for p in alive:
                p.terminate()
            for p in alive:
                p.join(5)
                if p.is_alive():
                    p.kill()
                    p.join(5)
        errors = []
        for r in range(world):
            err = os.path.join(out_dir, f"rank{r}.err")
            if os.path.exists(err):
                with open(err) as f:
                    errors.append(f"rank {r}:\n{f.read()}")
        if errors:
            raise FastSyncError("expert-parallel job failed:\n" + "\n".join(errors))
        if alive:
            raise FastSyncError(f"expert-parallel job {job['fn']} timed out after {timeout_s:.0f} s "
                                f"(ranks still running: {[procs.index(p) for p in alive]})")
        bad = [r for r, p in enumerate(procs) if p.exitcode != 0]
        if bad:
            raise FastSyncError(f"expert-parallel ranks {bad} exited with codes {[procs[r].exitcode for r in bad]}")
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]
