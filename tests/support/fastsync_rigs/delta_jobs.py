"""Process entry points for the delta-sync tests: trainer and engine ranks of a small synthetic
model with awkward sizes, syncing a schedule of dense and delta versions over real NIXL.

Trainer ranks hold fp32 shards (the master); engine ranks hold bf16 (or block-FP8) tensors.
Version ``v`` changes a seeded fraction of every parameter's elements (``update_fraction``), the
same draw in every process, so each engine rank can compute what it must hold at any version and
compare its live tensors bit for bit after every sync, failed or not.
"""

from __future__ import annotations

import os
import traceback
import zlib
from dataclasses import dataclass, field
from typing import Any

__all__ = ["DeltaJob", "job_model", "full_params", "trainer_job", "engine_job", "update_fraction"]


@dataclass(slots=True)
class DeltaJob:
    trainers: int
    rollouts: int
    port: int
    schedule: list[tuple[int, str]] = field(default_factory=list)  # (version, "dense" | "delta")
    fp8: bool = False
    verify: bool = True
    timeout_s: float = 60.0
    sync_timeout_s: float = 20.0
    abort_at: dict[int, int] = field(default_factory=dict)  # engine rank -> version it rolls back
    # engine rank -> version whose post-processing fails after the delta was written (rollback)
    fail_apply_at: dict[int, int] = field(default_factory=dict)
    kill_at: tuple[int, int, int] | None = None  # (trainer rank, version, page) at which it exits
    chunk_elems: int = 4099  # small chunks: many per tensor, the last one partial
    mode: str = "shadow"
    backup: bool = False
    page_bytes: int | None = None  # NIXL write size of the streams (small: many pages per stream)
    replicas: int = 1  # identical engines of TP rollouts // replicas each
    fanout: str = "off"  # with replicas: "chain" relays the streams down the replicas, "direct" does not


def update_fraction(version: int) -> float:
    return (0.0, 0.003, 0.05, 0.4)[version % 4]


def job_model(job: DeltaJob) -> Any:
    from types import SimpleNamespace

    from fastsync.plan.planner import build_plan
    from fastsync.bench.synthetic import ModelDims, engine_layout, fsdp_layout, small_model

    dims = ModelDims(layers=2, hidden=200, q_dim=136, kv_dim=68, inter=150, vocab=262, dtype="float32")
    params = small_model(dims)
    trainer = fsdp_layout(params, job.trainers)
    engine = engine_layout(params, dims, tp=job.rollouts // job.replicas, replicas=job.replicas, fp8=job.fp8,
                           dtype="bfloat16")
    plan = build_plan(params, trainer, engine, fanout=job.fanout if job.replicas > 1 else "off")
    return SimpleNamespace(params=params, trainer=trainer, engine=engine, plan=plan)


def _seed(*parts: object) -> int:
    return zlib.crc32("|".join(map(str, parts)).encode())


def full_params(model: Any, version: int, cache: dict | None = None) -> dict[str, Any]:
    """Every full parameter (fp32) at ``version``: seeded initial values plus the seeded sparse
    updates of versions 1..version."""
    import torch

    if cache is not None and cache.get("version", -1) <= version and "params" in cache:
        start, cur = cache["version"], {n: t.clone() for n, t in cache["params"].items()}
    else:
        start, cur = 0, {}
        for name, spec in model.params.items():
            g = torch.Generator().manual_seed(_seed(name, 0))
            cur[name] = torch.randn(spec.shape, generator=g).mul_(0.02)
    for v in range(start + 1, version + 1):
        frac = update_fraction(v)
        for name, t in cur.items():
            g = torch.Generator().manual_seed(_seed(name, v))
            mask = torch.rand(t.shape, generator=g) < frac
            t.add_(torch.randn(t.shape, generator=g).mul_(0.01) * mask)
    if cache is not None:
        cache["version"], cache["params"] = version, {n: t.clone() for n, t in cur.items()}
    return cur


def _env() -> None:
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    import torch

    torch.set_num_threads(1)


def trainer_job(job: DeltaJob, rank: int, results: Any) -> None:
    _env()
    import torch

    from fastsync.control import TCPStoreControl
    from fastsync.layout.box import box_slices
    from fastsync.layout.types import Shard
    from fastsync.bench.rows import KILLED_ON_PURPOSE
    from fastsync.sync.delta_sender import DeltaSender

    try:
        control = TCPStoreControl.client(job.port, timeout_s=job.timeout_s)
        model = job_model(job)
        mine = model.trainer.shards_on(rank)
        cache: dict = {}
        full = full_params(model, 0, cache)
        views = {n: full[n][box_slices(shs[0].box)].contiguous() for n, shs in mine.items()}
        shards = {n: [Shard(rank, shs[0].box, 0)] for n, shs in mine.items()}
        sender = DeltaSender(rank=rank, plan=model.plan, sources=views, shards=shards, control=control,
                             timeout_s=job.timeout_s, staging_bytes=64 << 10, chunk_elems=job.chunk_elems, page_bytes=job.page_bytes)
        sender.setup()
        for version, _mode in job.schedule:
            full = full_params(model, version, cache)
            for n, v in views.items():
                v.copy_(full[n][box_slices(mine[n][0].box)])
            on_page = None
            if job.kill_at is not None and job.kill_at[:2] == (rank, version):
                kill_page = job.kill_at[2]

                def on_page(k: int, _kp: int = kill_page) -> None:
                    if k >= _kp:
                        os._exit(KILLED_ON_PURPOSE)  # a trainer dying mid-delta, some pages already written
            control.barrier(f"delta/{version}", job.trainers + job.rollouts, job.timeout_s)
            row: dict[str, Any] = {"kind": "sync", "role": "trainer", "rank": rank, "version": version}
            try:
                sender.sync(version, timeout_s=job.sync_timeout_s, on_page=on_page)
                row.update(ok=True, **sender.last_stats)
            except Exception as e:
                row.update(ok=False, error=f"{type(e).__name__}: {e}")
            results.put(row)
        sender.close()
        results.put({"kind": "exit", "role": "trainer", "rank": rank})
    except BaseException as e:
        results.put({"kind": "crash", "role": "trainer", "rank": rank, "error": f"{type(e).__name__}: {e}",
                     "trace": traceback.format_exc()})
        raise


def engine_job(job: DeltaJob, rank: int, results: Any) -> None:
    _env()
    import torch

    from fastsync.control import TCPStoreControl
    from fastsync.executor.staging import as_bytes
    from fastsync.layout.types import EngineLayout
    from fastsync.sync.delta_receiver import DeltaReceiver
    from fastsync.bench.local import reference_engine_tensors

    try:
        control = TCPStoreControl.client(job.port, timeout_s=job.timeout_s)
        model = job_model(job)
        tensors = {n: torch.zeros(t.shape, dtype=getattr(torch, t.dtype)) for n, t in model.engine.tensors[rank].items()}
        sub = EngineLayout(model.engine.world_size, {rank: model.engine.tensors[rank]}, {}, model.engine.kind)
        rx = DeltaReceiver(rank=rank, plan=model.plan, tensors=tensors, control=control, verify=job.verify,
                           timeout_s=job.timeout_s, chunk_elems=job.chunk_elems, mode=job.mode, backup=job.backup)
        rx.setup()
        fail_v = job.fail_apply_at.get(rank)
        if fail_v is not None:
            from fastsync.errors import SyncError

            def on_apply() -> None:  # a stand-in for an engine's post-processing (repack) failing
                if rx._open == fail_v:
                    raise SyncError(f"test: engine rank {rank}'s post-processing fails after version {fail_v} "
                                    "was written")

            rx.landing.on_apply = on_apply  # type: ignore[attr-defined]
        cache: dict = {}
        for version, mode in job.schedule:
            control.barrier(f"delta/{version}", job.trainers + job.rollouts, job.timeout_s)
            row: dict[str, Any] = {"kind": "sync", "role": "engine", "rank": rank, "version": version, "mode": mode}
            try:
                rx.begin(version, dense=mode == "dense")
                import time as _t

                rx.wait(_t.monotonic() + job.sync_timeout_s)
                if job.abort_at.get(rank) == version:
                    rx.abort("test: this engine rank rolls back (as a restart or a failed flip would)")
                    row.update(ok=False, error="rolled back on purpose")
                else:
                    rx.finish()
                    row.update(ok=True, **rx.last_stats)
            except Exception as e:
                row.update(ok=False, error=f"{type(e).__name__}: {e}")
            row["served_version"] = rx.version
            if rx.version:
                want = reference_engine_tensors(full_params(model, rx.version, cache), sub)[rank]
                bad = [n for n, t in tensors.items() if not torch.equal(as_bytes(t), as_bytes(want[n].contiguous()))]
            else:
                bad = [n for n, t in tensors.items() if t.view(torch.uint8).any()]
            row["exact"], row["mismatch"] = not bad, bad[:4]
            results.put(row)
        rx.close()
        results.put({"kind": "exit", "role": "engine", "rank": rank})
    except BaseException as e:
        results.put({"kind": "crash", "role": "engine", "rank": rank, "error": f"{type(e).__name__}: {e}",
                     "trace": traceback.format_exc()})
        raise


def run_job(job: DeltaJob, timeout_s: float = 240.0) -> list[dict]:
    """Spawn every rank of ``job`` (127.0.0.1, one store owned here), collect their rows until all
    exited (or died: a killed trainer's exit code, ``KILLED_ON_PURPOSE``, is expected), kill what is left."""
    from dataclasses import replace

    from fastsync.bench.rows import KILLED_ON_PURPOSE, collect_rows, exits
    from fastsync.control import TCPStoreControl
    from fastsync.procs import rank_context

    store = TCPStoreControl.server(port=0, timeout_s=job.timeout_s)
    job = replace(job, port=store.port)
    ctx = rank_context()
    results = ctx.Queue()
    named = {f"engine {r}": ctx.Process(target=engine_job, args=(job, r, results), daemon=True)
             for r in range(job.rollouts)}
    named.update({f"trainer {t}": ctx.Process(target=trainer_job, args=(job, t, results), daemon=True)
                  for t in range(job.trainers)})
    procs = list(named.values())
    rows: list[dict] = []
    try:
        for p in procs:
            p.start()
        collect_rows(results, named, timeout_s=timeout_s, what="delta job", rows=rows, poll_s=0.5,
                     done=lambda got: exits(got) + sum(p.exitcode == KILLED_ON_PURPOSE for p in procs) >= len(procs))
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        results.close()
        store.close() if hasattr(store, "close") else None
    return rows
