"""Process entry points of the benchmark (and of the multi-process tests): one trainer rank or
one engine rank, syncing a list of versions over one or more transports.

Every process lines up at a control-plane barrier before each version, so a sync's wall time is
``max(end) - min(start)`` over all processes (one host, one clock). Results go to the parent
through a queue as plain dicts.
"""

from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

from fastsync.bench.rows import KILLED_ON_PURPOSE

__all__ = ["WorkerConfig", "trainer_main", "receiver_main", "gate_key"]


@dataclass(slots=True)
class WorkerConfig:
    trainers: int
    rollouts: int
    port: int
    size_bytes: int | None = None
    preset: str | None = None
    schedule: list[tuple[str, int, bool]] = field(default_factory=list)  # (transport, version, verify)
    staging_bytes: int = 256 << 20
    timeout_s: float = 60.0  # set-up, barriers
    sync_timeout_s: float | None = None  # deadline of each sync (default: timeout_s)
    mode: str = "inplace"
    backup: bool = True
    min_direct_run_bytes: int = 16 << 10
    check_exact: bool = False
    direct: bool = True
    overlap: bool = True
    torch_threads: int = 1
    # fault injection for tests: (trainer rank, version, chunk index) at which that trainer exits
    kill_at: tuple[int, int, int] | None = None
    # fault injection for tests: (engine rank, version) at which that engine rank's process exits,
    # after the version's barrier, while the other ranks begin the sync
    kill_engine_at: tuple[int, int] | None = None
    # a dead peer fails the version barriers within seconds (off: wait there for a replacement
    # process, as a test that restarts a killed rank does)
    watch_peers: bool = True
    rank0_bucket_bytes: int = 256 << 20
    fp8: bool = False  # engine holds block-FP8 weights + scales (the plan then has owner gathers)
    device: str = "cpu"  # where trainer shards and engine tensors live ("cuda": VRAM on the one GPU)
    trace: bool = False  # record every phase as a span (rows then carry "spans": fastsync bench --trace)
    replicas: int = 1  # the engine ranks form this many identical engines
    fanout: str = "chain"  # how replicas are fed (plan/relay.py): chain (relays), auto, direct
    # fault injection for tests: (engine rank, version) at which that engine rank exits mid-sync,
    # with the version open (a relay dying before it forwards)
    kill_engine_open_at: tuple[int, int] | None = None
    control_host: str = "127.0.0.1"  # where the parent's store listens (a host address on a rig)
    # the parent lets each version through its barrier (``gate/{barrier}``) after reading the NIC
    # counters, so per-version NIC bytes are exact (fastsync.bench.cluster.gated_collect)
    gate: bool = False
    # fastsync bench --delta: a seeded fraction of the weights changes per version (not all of
    # them), the nixl transport runs DeltaSender/DeltaReceiver: dense first, then deltas
    delta: bool = False
    delta_fraction: float = 0.01
    # every engine rank checks what it serves against an independent reference after each sync,
    # off the clock (fastsync.bench.after_clock): rows carry check_ok / check_mismatch / check_s
    check_after: bool = True
    # untimed syncs per transport at the start of ``schedule`` (which syncs the fault hook of
    # fastsync.bench.faults counts as timed)
    warmup: int = 1
    # fastsync bench --verify: what every engine rank checks before each flip, inside the timed
    # sync (off | sample | full; fastsync.executor.verify); the extra checked sync is always full
    verify_mode: str = "off"
    # fastsync bench --corrupt K: engine rank 0 flips one byte of a tensor it received after the
    # writes of each transport's K-th timed sync landed, before the check and the flip
    corrupt: int | None = None


def _env(cfg: WorkerConfig) -> None:
    import faulthandler

    faulthandler.enable()  # a rank that dies in native code (exit -11) prints its Python stack on stderr
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    if cfg.trace:
        from fastsync.trace import enable

        enable()
    import torch

    torch.set_num_threads(cfg.torch_threads)


def _model(cfg: WorkerConfig, control: Any):
    from fastsync.bench.model import build_bench_model
    from fastsync.errors import PlanError
    from fastsync.plan.types import Plan

    model = build_bench_model(trainers=cfg.trainers, rollouts=cfg.rollouts, size_bytes=cfg.size_bytes,
                              preset=cfg.preset, fp8=cfg.fp8, replicas=cfg.replicas, fanout=cfg.fanout)
    shared = Plan.loads(control.get("bench/plan", cfg.timeout_s, what="the benchmark parent").decode())
    if shared.plan_hash != model.plan.plan_hash:
        raise PlanError(f"this process planned {model.plan.plan_hash}, the parent {shared.plan_hash}")
    return model


def _transport_options(name: str, cfg: WorkerConfig) -> dict:
    if name == "nixl":
        return {"overlap": cfg.overlap}
    if name == "torch":
        return {"overlap": cfg.overlap}
    if name == "rank0":
        return {"bucket_bytes": cfg.rank0_bucket_bytes}
    return {}


def _world_if_gathers(cfg: WorkerConfig, control: Any, model: Any, global_rank: int) -> None:
    """Owner gathers run over the default torch.distributed group: every process joins it."""
    if model.plan.gathers:
        from fastsync.transport._dist import ensure_world

        ensure_world(control, global_rank, cfg.trainers + cfg.rollouts, cfg.timeout_s)


def _liveness(cfg: WorkerConfig, control: Any, role: str, rank: int) -> Any:
    """This process's heartbeat and a watch over every other benchmark process."""
    from fastsync.sync.liveness import Heartbeat, PeerWatch

    Heartbeat(control.with_prefix("bench"), role, rank)
    peers = [("trainer", t) for t in range(cfg.trainers)] + [("engine", r) for r in range(cfg.rollouts)]
    return PeerWatch(control.with_prefix("bench"), [p for p in peers if p != (role, rank)], who=f"{role} rank {rank}")


def _exit_now(results: Any) -> None:
    """After a crash row is queued: end the process at once (transport teardown towards dead
    peers can take many seconds; the host's resources go with the process anyway)."""
    import sys

    traceback.print_exc(file=sys.stderr)
    results.close()
    results.join_thread()
    sys.stderr.flush()
    os._exit(1)


def _barrier_name(transport: str, version: int) -> str:
    return f"bench/{transport}/{version}"


def gate_key(transport: str, version: int) -> str:
    """The key the parent sets to let ``version`` of ``transport`` through its barrier
    (``WorkerConfig.gate``)."""
    return f"gate/{_barrier_name(transport, version)}"


def _barrier(cfg: WorkerConfig, control: Any, name: str, watch: Any, me: int) -> None:
    """The version's barrier; a dead peer fails it within seconds, naming the peer. Each process
    sets its own arrival key (a retry after a store timeout cannot count twice); process 0 (trainer
    rank 0) sets ``go`` once every arrival is there. A store that does not answer is retried until
    the barrier's deadline (a cut link that comes back costs nothing)."""
    from fastsync.control import StoreUnreachable
    from fastsync.errors import SyncError
    from fastsync.protocol import barrier_go_key, barrier_member_key
    from fastsync.sync.liveness import wait_key

    n = cfg.trainers + cfg.rollouts
    deadline = time.monotonic() + cfg.timeout_s
    what = f"barrier {name!r} ({n} ranks)"
    while True:
        try:
            control.set(barrier_member_key(name, me), b"1", timeout_s=max(min(deadline - time.monotonic(), 2.0), 0.05))
            break
        except StoreUnreachable as e:
            if time.monotonic() >= deadline:
                raise SyncError(f"control plane: {what}: the store did not answer by the deadline: {e}") from e
    if me == 0:
        for i in range(n):
            wait_key(control, barrier_member_key(name, i), deadline, f"process {i} at {what}",
                     watch if cfg.watch_peers else None)
        if cfg.gate:
            wait_key(control, f"gate/{name}", deadline, f"the parent's gate at {what}", None)
        control.set(barrier_go_key(name), b"1", timeout_s=max(deadline - time.monotonic(), 1.0))
        return
    wait_key(control, barrier_go_key(name), deadline, what, watch if cfg.watch_peers else None)


def _fail_on_finish(rx: Any, version: int, transport: str) -> None:
    """The test-only fault hook (:data:`fastsync.bench.faults.FAIL_SYNC_ENV`): this sync's
    ``finish`` refuses the version once its writes landed, rolling it back as a failed
    verification would (the caller removes the override after the sync)."""
    from fastsync.bench.faults import FAIL_SYNC_ENV
    from fastsync.errors import SyncError

    def finish() -> int:
        why = f"{FAIL_SYNC_ENV} (test-only fault hook) failed {transport} version {version}"
        rx.abort(why)
        raise SyncError(f"engine rank {rx.rank}: version {version} refused, keeping version {rx.version}: {why}")

    rx.finish = finish


def _sync_corrupting_one_byte(rx: Any, version: int, cfg: WorkerConfig, corrupted: dict) -> None:
    """``fastsync bench --corrupt``: one sync in which one byte of the largest tensor this rank
    received is flipped after the writes landed and before ``finish`` checks and flips; what was
    flipped goes in ``corrupted`` (the verification, when on, must refuse the version naming it)."""
    rx.begin(version)
    rx.wait(time.monotonic() + (cfg.sync_timeout_s or rx.timeout_s))
    _, items = rx.program.by_origin()[0]
    it = max(items, key=lambda i: i.transfer.nbytes)
    off = it.dst_runs[0][0]
    rx.landing.regions[it.transfer.dst_tensor][off: off + 1].bitwise_not_()
    corrupted.update(tensor=it.transfer.dst_tensor, byte=off, engine_rank=rx.rank)
    rx.finish()


def trainer_main(cfg: WorkerConfig, rank: int, results: Any) -> None:
    _env(cfg)
    from fastsync.bench.model import step_values, trainer_buffers
    from fastsync.control import TCPStoreControl
    from fastsync.sync.delta_sender import DeltaSender
    from fastsync.sync.sender import WeightSender

    try:
        control = TCPStoreControl.client(cfg.port, host=cfg.control_host, timeout_s=cfg.timeout_s)
        watch = _liveness(cfg, control, "trainer", rank)
        model = _model(cfg, control)
        _world_if_gathers(cfg, control, model, rank)
        flat, views, shards = trainer_buffers(model, rank, device=cfg.device)
        sign_version = 0
        senders: dict[str, WeightSender | DeltaSender] = {}
        for name, version, verify in cfg.schedule:
            if name not in senders:
                kw = dict(rank=rank, plan=model.plan, sources=views, shards=model.trainer,
                          control=control.with_prefix(f"fs/{name}"), transport=name,
                          transport_options=_transport_options(name, cfg), staging_bytes=cfg.staging_bytes,
                          direct=cfg.direct, min_direct_run_bytes=cfg.min_direct_run_bytes, timeout_s=cfg.timeout_s)
                s = DeltaSender(**kw) if cfg.delta else WeightSender(**kw)
                t0 = time.perf_counter()
                s.setup()
                results.put({"kind": "setup", "role": "trainer", "rank": rank, "transport": name,
                             "seconds": time.perf_counter() - t0})
                senders[name] = s
            if cfg.delta:  # a few elements move per version, as after an optimizer step
                for v in range(sign_version + 1, version + 1):
                    for n, view in views.items():
                        if view.numel():
                            step_values(model.params[n], shards[n][0].box, v, cfg.delta_fraction, view)
            elif (version - sign_version) % 2:
                flat.neg_()
            sign_version = version
            on_chunk = None
            if cfg.kill_at is not None and cfg.kill_at[:2] == (rank, version):
                kill_chunk = cfg.kill_at[2]

                def on_chunk(k: int, _kc: int = kill_chunk) -> None:
                    if k >= _kc:
                        os._exit(KILLED_ON_PURPOSE)  # a trainer dying mid-sync, some writes already landed
            _barrier(cfg, control, _barrier_name(name, version), watch, rank)
            t_start = time.time()
            try:
                if cfg.delta:
                    m = senders[name].sync(version, timeout_s=cfg.sync_timeout_s)
                    results.put({"kind": "sync", **m.to_json(), "payload": senders[name].last_stats})
                else:
                    m = senders[name].sync(version, on_chunk=on_chunk, timeout_s=cfg.sync_timeout_s)
                    results.put({"kind": "sync", **m.to_json()})
            except Exception as e:  # reported, the run goes on to the next version
                results.put({"kind": "sync", "role": "trainer", "rank": rank, "transport": name,
                             "version": version, "ok": False, "error": f"{type(e).__name__}: {e}",
                             "start": t_start, "end": time.time()})
        for s in senders.values():
            s.close()
        results.put({"kind": "exit", "role": "trainer", "rank": rank})
    except BaseException as e:
        results.put({"kind": "crash", "role": "trainer", "rank": rank,
                     "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()})
        _exit_now(results)


def receiver_main(cfg: WorkerConfig, rank: int, results: Any) -> None:
    _env(cfg)
    import torch

    from fastsync.bench.after_clock import AfterClockCheck
    from fastsync.bench.faults import fail_version, timed_versions
    from fastsync.bench.model import reference_tensors
    from fastsync.control import TCPStoreControl
    from fastsync.sync.delta_receiver import DeltaReceiver
    from fastsync.sync.receiver import WeightReceiver
    from fastsync.executor.staging import Landing, as_bytes

    try:
        control = TCPStoreControl.client(cfg.port, host=cfg.control_host, timeout_s=cfg.timeout_s)
        watch = _liveness(cfg, control, "engine", rank)
        model = _model(cfg, control)
        _world_if_gathers(cfg, control, model, cfg.trainers + rank)
        tensors = {n: torch.zeros(t.shape, dtype=getattr(torch, t.dtype), device=cfg.device)
                   for n, t in model.engine.tensors[rank].items()}
        backup = cfg.backup and cfg.mode == "inplace"
        landing = None if cfg.delta else Landing(tensors, mode=cfg.mode, backup=backup)
        receivers: dict[str, WeightReceiver] = {}
        served_version = 0
        dense_ok = False  # --delta: a delta needs the last version complete here
        checker = (AfterClockCheck(model, rank, cfg.delta_fraction if cfg.delta else None)
                   if cfg.check_after else None)
        fail_at = fail_version(cfg.schedule, cfg.warmup) if rank == 0 else None  # test-only fault hook
        corrupt_at = ({vs[cfg.corrupt - 1] for vs in timed_versions(cfg.schedule, cfg.warmup).values()
                       if len(vs) >= cfg.corrupt} if cfg.corrupt and rank == 0 else set())
        for name, version, verify in cfg.schedule:
            if name not in receivers:
                kw = dict(rank=rank, plan=model.plan, tensors=tensors, control=control.with_prefix(f"fs/{name}"),
                          transport=name, transport_options=_transport_options(name, cfg),
                          engine_hash=model.engine.fingerprint(), timeout_s=cfg.timeout_s,
                          initial_version=served_version)
                rx = (DeltaReceiver(mode=cfg.mode, backup=backup, **kw) if cfg.delta else
                      WeightReceiver(landing=landing, **kw))
                t0 = time.perf_counter()
                rx.setup()
                results.put({"kind": "setup", "role": "engine", "rank": rank, "transport": name,
                             "seconds": time.perf_counter() - t0})
                receivers[name] = rx
            rx = receivers[name]
            rx.verify = "full" if verify else cfg.verify_mode
            _barrier(cfg, control, _barrier_name(name, version), watch, cfg.trainers + rank)
            if cfg.kill_engine_at == (rank, version):
                results.put({"kind": "killed", "role": "engine", "rank": rank, "version": version, "time": time.time()})
                time.sleep(0.2)  # let the queue's feeder thread hand the row over
                os._exit(KILLED_ON_PURPOSE)  # an engine rank dying as the others begin the version
            row: dict[str, Any]
            if cfg.kill_engine_open_at == (rank, version):
                rx.begin(version)  # an engine rank (a relay) dying with the version open, before it forwards
                results.close()
                results.join_thread()  # rows already put (earlier versions) reach the parent first
                os._exit(KILLED_ON_PURPOSE)
            try:
                if version == fail_at:
                    _fail_on_finish(rx, version, name)
                corrupted: dict = {}
                if cfg.delta:  # dense while nothing complete is held (or after a failure), else a delta
                    rx.sync(version, dense=not dense_ok, timeout_s=cfg.sync_timeout_s)
                elif version in corrupt_at:
                    _sync_corrupting_one_byte(rx, version, cfg, corrupted)
                else:
                    rx.sync(version, timeout_s=cfg.sync_timeout_s)
                row = {"kind": "sync", **rx.last_metrics.to_json(), "verified": bool(verify),
                       "payload": rx.last_stats, "verify": rx.last_verify}

                served_version = version
                dense_ok = True
            except Exception as e:
                dense_ok = False
                m = rx.last_metrics
                row = {"kind": "sync", **(m.to_json() if m is not None and m.version == version else
                                          {"role": "engine", "rank": rank, "transport": name, "version": version}),
                       "ok": False, "error": f"{type(e).__name__}: {e}"}
            finally:
                if corrupted:
                    row["corrupted"] = corrupted
                rx.__dict__.pop("finish", None)  # the fault hook's, if it was set
            row["served_version"] = rx.version
            # between syncs, while trainers would train: refresh the in-place backup (off the sync's path)
            row["prepare_s"] = rx.prepare()
            if cfg.check_exact:
                want = (reference_tensors(model, rank, rx.version, cfg.delta_fraction if cfg.delta else None)
                        if rx.version else None)
                if want is None:
                    row["exact"] = all(not t.any() for t in tensors.values())
                else:
                    bad = [n for n, t in tensors.items() if not torch.equal(as_bytes(t), as_bytes(want[n].contiguous()))]
                    row["exact"] = not bad
                    row["exact_mismatch"] = bad[:5]
            if checker is not None:  # after the clock: the row's start/end are already taken
                bad = checker.check(tensors, rx.version)
                row.update(check_ok=not bad, check_mismatch=bad[:5], check_s=checker.last_s)
            results.put(row)
            # later transports continue from the version this one serves
            for other in receivers.values():
                other.version = max(other.version, rx.version)
        for rx in receivers.values():
            rx.close()
        results.put({"kind": "exit", "role": "engine", "rank": rank})
    except BaseException as e:
        results.put({"kind": "crash", "role": "engine", "rank": rank,
                     "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()})
        _exit_now(results)
