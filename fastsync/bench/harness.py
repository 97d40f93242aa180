"""Process orchestration for ``fastsync bench`` and the multi-process tests.

The parent owns the control-plane store (so a dying worker never takes it down), plans once,
publishes the plan, starts ``T`` trainer and ``R`` inference processes (``fastsync.procs``: forked
from a server that imported torch once; 127.0.0.1 only), and collects their per-sync rows with a
deadline. Workers are always joined or killed on the way out.
"""

from __future__ import annotations

import os
import queue
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import replace
from typing import Any, Callable

from fastsync.bench.faults import FAIL_SYNC_ENV, fail_version
from fastsync.bench.model import BenchModel, build_bench_model
from fastsync.bench.rows import collect_rows
from fastsync.bench.trace_out import write_bench_trace
from fastsync.bench.workers import WorkerConfig, receiver_main, trainer_main
from fastsync.control import TCPStoreControl
from fastsync.errors import ConfigError, SyncError
from fastsync.layout.box import box_numel
from fastsync.layout.types import DTYPE_BYTES
from fastsync.procs import rank_context
from fastsync.trace.progress import Steps

__all__ = ["Cluster", "run_bench", "summarize", "bench_ok", "make_schedule"]


class Cluster:
    """A set of worker processes sharing one store. Use as a context manager.

    With ``rig`` (a :class:`~fastsync.bench.netns_cluster.HostRig`) every process runs on the rig host
    ``placement[(role, rank)]`` and the store listens at the address of ``store_host`` (default:
    the host of trainer rank 0).
    """

    def __init__(self, cfg: WorkerConfig, model: BenchModel | None = None, rig: Any = None,
                 placement: dict[tuple[str, int], int] | None = None, store_host: int | None = None) -> None:
        self.rig, self.placement = rig, placement
        if rig is not None:
            if placement is None:
                raise ConfigError("Cluster(rig=...) needs placement= (role, rank) -> host index")
            home = placement[("trainer", 0)] if store_host is None else store_host
            with rig.entered(home):
                self.control = TCPStoreControl.server(port=0, host=rig.addr(home), timeout_s=cfg.timeout_s)
            cfg = replace(cfg, control_host=rig.addr(home))
        else:
            self.control = TCPStoreControl.server(port=0, timeout_s=cfg.timeout_s)
        self.cfg = replace(cfg, port=self.control.port)
        self.model = model or build_bench_model(trainers=cfg.trainers, rollouts=cfg.rollouts,
                                                size_bytes=cfg.size_bytes, preset=cfg.preset, fp8=cfg.fp8,
                                                replicas=cfg.replicas, fanout=cfg.fanout)
        self.control.set("bench/plan", self.model.plan.dumps())
        self.ctx = rank_context()
        self.results = self.ctx.Queue()
        self.procs: dict[tuple[str, int, int], Any] = {}
        self.rows: list[dict] = []

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def spawn(self, role: str, rank: int, cfg: WorkerConfig | None = None) -> Any:
        target = trainer_main if role == "trainer" else receiver_main
        args: tuple = (cfg or self.cfg, rank, self.results)
        if self.rig is not None:
            from fastsync.bench.netns import run_in_host

            host = self.placement[(role, rank)]
            args = (self.rig.hosts[host].ns, self.rig.env(host, {}), target, *args)
            target = run_in_host
        p = self.ctx.Process(target=target, args=args, daemon=True, name=f"fastsync-{role}{rank}")
        p.start()
        self.procs[(role, rank, len(self.procs))] = p
        return p

    def start(self, schedule: list[tuple[str, int, bool]]) -> None:
        self.cfg.schedule = list(schedule)
        for r in range(self.cfg.rollouts):
            self.spawn("engine", r)
        for t in range(self.cfg.trainers):
            self.spawn("trainer", t)

    def collect(self, done: Callable[[list[dict]], bool], timeout_s: float,
                on_row: Callable[[dict], None] | None = None) -> list[dict]:
        """Gather rows until ``done(rows)`` or the deadline; SyncError on a crash or timeout."""
        procs = {f"{k[0]} {k[1]}": p for k, p in self.procs.items()}
        return collect_rows(self.results, procs, done=done, timeout_s=timeout_s, what="benchmark workers",
                            rows=self.rows, on_row=on_row)

    def drain(self, grace_s: float, on_row: Callable[[dict], None] | None = None) -> list[str]:
        """After a failure: keep reading rows until every worker exited or ``grace_s`` passed
        (then :meth:`close` kills the rest). Returns the crash errors seen meanwhile."""
        errors: list[str] = []
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(p.exitcode is None for p in self.procs.values()):
            try:
                row = self.results.get(timeout=0.2)
            except queue.Empty:
                continue
            if row.get("kind") == "crash":
                errors.append(f"{row['role']} rank {row['rank']}: {row['error']}")
            else:
                self.rows.append(row)
                if on_row is not None:
                    on_row(row)
        while True:  # rows already queued by workers that ended
            try:
                row = self.results.get(timeout=0.05)
            except queue.Empty:
                break
            if row.get("kind") == "crash":
                errors.append(f"{row['role']} rank {row['rank']}: {row['error']}")
            else:
                self.rows.append(row)
        return errors

    def close(self) -> None:
        for p in self.procs.values():
            p.join(timeout=5)
        for p in self.procs.values():
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        self.results.close()


def make_schedule(transports: list[str], steps: int, warmup: int = 1, verify: bool = True,
                  interleave: bool = True) -> list[tuple[str, int, bool]]:
    """``(transport, version, verify)`` in run order: ``warmup`` untimed syncs per transport, then
    ``steps`` timed ones (round-robin across transports when ``interleave``, so load from other
    work on the host hits every transport alike), then one verified sync per transport."""
    out: list[tuple[str, int, bool]] = []

    def add(name: str, ver: bool) -> None:
        out.append((name, len(out) + 1, ver))

    for name in transports:
        for _ in range(warmup):
            add(name, False)
    if interleave:
        for _ in range(steps):
            for name in transports:
                add(name, False)
    else:
        for name in transports:
            for _ in range(steps):
                add(name, False)
    if verify:
        for name in transports:
            add(name, True)
    return out


def engine_stall_seconds(row: dict, mode: str) -> float:
    """How long an engine rank's live tensors held no complete version during one sync (what an
    engine generating from them would have to pause for): the whole receive when dense writes
    land in place, only the flip's copy (``apply``) with a shadow, and for a delta only writing
    it in and what follows (``apply``, ``verify``, ``postprocess``), not its arrival."""
    stages = row.get("stages", {})
    if (row.get("payload") or {}).get("mode") == "delta":
        return sum(stages.get(k, 0.0) for k in ("apply", "verify", "postprocess"))
    if mode == "shadow":
        return stages.get("apply", 0.0)
    return row["end"] - row["start"]


def summarize(rows: list[dict], schedule: list[tuple[str, int, bool]], warmup: int, model: BenchModel,
              num_procs: int, mode: str = "inplace") -> dict:
    """Per transport: median seconds per sync over the timed syncs that succeeded, aggregate
    GB/s, stage medians per role, the engines' stall (:func:`engine_stall_seconds`, the slowest
    engine rank per sync), and the honesty figures: ``failed_syncs`` (timed syncs that failed or
    did not report from every process: they stay in ``seconds_all`` as None), ``verified_syncs``
    ("k/n": timed syncs every engine rank checked against the reference after the clock stopped,
    :mod:`fastsync.bench.after_clock`), ``checksum_verified`` (the extra untimed sync verified by
    the senders' checksums inside the protocol), and ``verified``: every timed sync verified
    after the clock and the checksum sync passed."""
    by_v: dict[int, list[dict]] = defaultdict(list)
    for r in rows:
        if r.get("kind") == "sync":
            by_v[r["version"]].append(r)
    out: dict[str, Any] = {}
    order: dict[str, list[tuple[int, bool]]] = defaultdict(list)
    for name, v, verify in schedule:
        order[name].append((v, verify))
    nbytes = model.plan.bytes_total
    for name, vs in order.items():
        secs, stages_t, stages_r, errors, ratios, stalls = [], defaultdict(list), defaultdict(list), [], [], []
        verify_s: list[float] = []
        digest_s: list[float] = []  # of verify_s: the engine rank's own digest (the rest waits for the senders')
        modes: set[str] = set()
        corrupted: list[dict] = []
        checksum_verified = None
        exact: list[bool] = []
        num_timed = num_failed = num_checked = num_failed_untimed = 0
        for i, (v, verify) in enumerate(vs):
            rs = by_v.get(v, [])
            exact += [bool(r["exact"]) for r in rs if "exact" in r]
            bad = [r for r in rs if not r.get("ok")]
            errors += [f"v{v} {r['role']} {r['rank']}: {r.get('error', '')}" for r in bad]
            failed = bool(bad) or len(rs) != num_procs
            if len(rs) != num_procs:
                errors.append(f"v{v}: {len(rs)} of {num_procs} processes reported")
            eng = [r for r in rs if r["role"] == "engine"]
            if verify:
                checksum_verified = bool(eng) and not failed
                continue
            if i < warmup:
                num_failed_untimed += failed
                continue
            num_timed += 1
            corrupted += [r["corrupted"] for r in rs if r.get("corrupted")]
            if failed:
                num_failed += 1
                secs.append(None)
                continue
            if eng and all(r.get("check_ok") for r in eng):
                num_checked += 1
            else:
                errors += [f"v{v} engine {r['rank']}: after the sync holds the wrong bytes in "
                           f"{r.get('check_mismatch') or 'unchecked tensors'}" for r in eng if not r.get("check_ok")]
            secs.append(max(r["end"] for r in rs) - min(r["start"] for r in rs))
            stalls.append(max(engine_stall_seconds(r, mode) for r in rs if r["role"] == "engine"))
            modes.update(r["verify"]["mode"] for r in eng if (r.get("verify") or {}).get("mode"))
            if any("verify" in r.get("stages", {}) for r in eng):  # the slowest engine rank's check of this sync
                verify_s.append(max(r.get("stages", {}).get("verify", 0.0) for r in eng))
                digest_s.append(max((r.get("verify") or {}).get("digest_s", 0.0) for r in eng))
            sent = [r["payload"] for r in rs if r["role"] == "trainer" and r.get("payload", {}).get("mode") == "delta"]
            if sent:  # --delta: stream bytes against the dense bytes of the same version
                ratios.append(sum(p["bytes_sent"] for p in sent) / max(1, sum(p["bytes_dense"] for p in sent)))
            for r in rs:
                if "prepare_s" in r:
                    stages_r["prepare_between_syncs"].append(r["prepare_s"])
                dst = stages_t if r["role"] == "trainer" else stages_r
                for k, s in r.get("stages", {}).items():
                    dst[k].append(s)
        ok_secs = [x for x in secs if x is not None]
        med = statistics.median(ok_secs) if ok_secs else None
        # bytes each trainer rank wrote, and engine ranks relayed, in the last complete sync (links as measured)
        last = next((by_v[v] for v, _ in reversed(vs) if len(by_v.get(v, [])) == num_procs), [])
        egress = [sum(r.get("bytes_per_link", {}).values()) for r in last if r["role"] == "trainer"]
        relayed = sum(n for r in last if r["role"] == "engine"
                      for link, n in r.get("bytes_per_link", {}).items() if link.startswith("r"))
        out[name] = {
            "trainer_egress_bytes_max": max(egress) if egress else None,
            "payload": "delta" if ratios else "dense",
            "delta_bytes_ratio": statistics.median(ratios) if ratios else None,
            "relayed_bytes": relayed if last else None,
            "seconds_median": med,
            "seconds_all": secs,  # one per timed sync, in run order; None where it failed
            "timed_syncs": num_timed,
            "failed_syncs": num_failed,
            "failed_untimed_syncs": num_failed_untimed,
            # the bench's engines do not generate: no requests are in flight during its syncs
            "engine_stall_seconds": statistics.median(stalls) if stalls else None,
            "gbps": (nbytes / med / 1e9) if med else None,
            "verified_syncs": f"{num_checked}/{num_timed}",
            # fastsync bench --verify: the in-protocol check of every timed sync (inside its seconds)
            "verify_mode": "/".join(sorted(modes)) if modes else "off",
            "verify_seconds_median": statistics.median(verify_s) if verify_s else None,
            "verify_digest_seconds_median": statistics.median(digest_s) if digest_s else None,
            "corrupted": corrupted,
            "checksum_verified": checksum_verified,
            "verified": num_timed > 0 and num_checked == num_timed and checksum_verified is True,
            "exact": all(exact) if exact else None,
            "stages_trainer": {k: statistics.median(v) for k, v in sorted(stages_t.items())},
            "stages_engine": {k: statistics.median(v) for k, v in sorted(stages_r.items())},
            "errors": errors[:10],
        }
    return out


def bench_ok(result: dict) -> bool:
    """The exit verdict of a ``fastsync bench`` result: no run error, and for every transport no
    failed sync (timed or not), every timed sync verified, and no exact-check failure."""
    return result.get("error") is None and all(
        r["verified"] and r["seconds_median"] is not None and not r["failed_syncs"]
        and not r.get("failed_untimed_syncs") and r.get("exact") is not False
        for r in result["transports"].values())


class _Progress:
    def __init__(self, total: int, stream: Any, enabled: bool) -> None:
        self.total, self.stream, self.enabled = total, stream, enabled
        self.done: dict[int, int] = defaultdict(int)
        self.count = 0

    def __call__(self, row: dict, num_procs: int, label: dict[int, str]) -> None:
        if row.get("kind") != "sync" or not self.enabled:
            return
        self.done[row["version"]] += 1
        if self.done[row["version"]] == num_procs:
            self.count += 1
            width = 30
            fill = int(width * self.count / max(self.total, 1))
            self.stream.write(f"\r[{'#' * fill}{'.' * (width - fill)}] {self.count}/{self.total} "
                              f"syncs ({label.get(row['version'], '')})   ")
            if self.count == self.total:
                self.stream.write("\n")
            self.stream.flush()


def check_memory(model: BenchModel, cfg: WorkerConfig) -> None:
    """Refuse a benchmark whose copies cannot fit in this host's memory: the trainers hold the
    model once (sharded), the engines once plus a backup or shadow copy."""
    import os

    try:
        phys = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return
    need = 3 * model.nbytes
    if need > phys:
        raise ConfigError(f"benchmark model {model.description} is {model.nbytes / (1 << 30):.3g} GiB: trainers and "
                          f"engines with their backups need about {need / (1 << 30):.3g} GiB, more than this host's "
                          f"{phys / (1 << 30):.3g} GiB (lower --size-gb)")


def run_bench(cfg: WorkerConfig, transports: list[str], steps: int, warmup: int = 1,
              progress: bool | None = None, trace_file: str | None = None, plot_file: str | None = None,
              rig: Any = None, placement: dict[tuple[str, int], int] | None = None) -> dict:
    """Run the benchmark end to end; returns the JSON-able result. With ``trace_file`` /
    ``plot_file`` (``cfg.trace`` on) also writes the measured trace / its timeline figure."""
    schedule = make_schedule(transports, steps, warmup)
    fault = fail_version(schedule, warmup)  # the test-only fault hook: refuse a malformed one before any process starts
    if cfg.corrupt is not None and cfg.corrupt > steps:
        raise ConfigError(f"--corrupt {cfg.corrupt}: only {steps} timed syncs per transport (--steps)")
    cfg = replace(cfg, warmup=warmup)
    num_procs = cfg.trainers + cfg.rollouts
    label = {v: name for name, v, _ in schedule}
    show = sys.stderr.isatty() if progress is None else progress
    bar = _Progress(len(schedule), sys.stderr, show)
    setup = Steps(3, enabled=show, desc="fastsync bench set-up")
    setup.next("building the model and the plan")

    def on_row(r: dict) -> None:
        if r.get("kind") == "setup":
            setup.next(f"transport set-up ({r['transport']}, {r['role']} {r['rank']})")
        if r.get("kind") == "sync":
            setup.close()
        bar(r, num_procs, label)

    t0 = time.monotonic()
    model = build_bench_model(trainers=cfg.trainers, rollouts=cfg.rollouts, size_bytes=cfg.size_bytes,
                              preset=cfg.preset, fp8=cfg.fp8, replicas=cfg.replicas, fanout=cfg.fanout)
    check_memory(model, cfg)
    per_version_nic: dict[int, int] = {}
    if rig is not None:
        cfg = replace(cfg, gate=True)
    with Cluster(cfg, model, rig=rig, placement=placement) as cluster:
        setup.next(f"starting {num_procs} worker processes")
        cluster.start(schedule)
        per_sync = cfg.timeout_s
        error: str | None = None
        worker_errors: list[str] = []
        try:
            if rig is not None:
                from fastsync.bench.cluster import gated_collect

                per_version_nic = gated_collect(cluster, schedule, num_procs, 120 + per_sync * len(schedule), on_row)
                rows = cluster.rows
            else:
                rows = cluster.collect(lambda rs: sum(r.get("kind") == "exit" for r in rs) == num_procs,
                                       timeout_s=120 + per_sync * len(schedule), on_row=on_row)
        except SyncError as e:  # a worker died or crashed: keep what the finished syncs measured
            error = str(e).split("\n", 1)[0]
            worker_errors = cluster.drain(grace_s=10.0, on_row=on_row)
            rows = cluster.rows
        finally:
            setup.close()
        ended = time.time()
        alive = [f"{k[0]} {k[1]}" for k, p in cluster.procs.items() if p.exitcode is None]
        model = cluster.model
    result = summarize(rows, schedule, warmup, model, num_procs, cfg.mode)
    files = {"trace_file": trace_file, "plot_file": plot_file}
    if trace_file is not None or plot_file is not None:
        write_bench_trace(trace_file, rows, schedule, plot=plot_file, warmup=warmup,
                          title=f"{model.description}: {cfg.trainers} trainer -> {cfg.rollouts} engine processes")
    base = (result.get("rank0") or {}).get("seconds_median")
    speedup = {n: (base / r["seconds_median"]) if base and r["seconds_median"] else None
               for n, r in result.items() if n != "rank0"}
    setup = defaultdict(list)
    for r in rows:
        if r.get("kind") == "setup":
            setup[r["transport"]].append(r["seconds"])
    default = "nixl" if "nixl" in result else (transports[0] if transports else None)
    completed = sorted(v for _, v, _ in schedule
                       if sum(r.get("kind") == "sync" and r.get("version") == v and r.get("ok") for r in rows) == num_procs)
    killed = [r for r in rows if r.get("kind") == "killed"]
    failure = None if error is None else {
        "error": error,
        "worker_errors": worker_errors,
        "killed": [{k: r[k] for k in ("role", "rank", "version")} for r in killed],
        "all_ended_s_after_kill": (ended - killed[0]["time"]) if killed else None,
        "killed_at_exit": alive,
    }
    cluster_info: dict[str, Any] = {}
    if rig is not None:
        from fastsync.bench.cluster import nic_summary

        for name, n in nic_summary(per_version_nic, schedule, warmup).items():
            if name in result:
                result[name]["nic_bytes"] = n
        cluster_info["nic_bytes_per_version"] = {str(v): n for v, n in sorted(per_version_nic.items())}
    return {
        **cluster_info,
        "error": failure,
        "completed_versions": completed,
        "model": model.description,
        "bytes_per_sync": model.plan.bytes_total,
        "num_tensors": len(model.params),
        "num_transfers": len(model.plan.transfers),
        "replicas": cfg.replicas,
        "fanout": model.plan.meta.get("fanout_mode", "off"),
        "trainer_shard_bytes_max": max(
            sum(box_numel(sh.box) * DTYPE_BYTES[model.params[n].dtype] for n, shs in model.trainer.shards.items()
                for sh in shs if sh.rank == r) for r in range(model.trainer.world_size)),
        "trainers": cfg.trainers,
        "rollouts": cfg.rollouts,
        "steps": steps,
        "warmup": warmup,
        "staging_bytes": cfg.staging_bytes,
        "transports": result,
        # test-only (fastsync.bench.faults): the version the fault hook made fail, None in a real run
        "fault_injected": None if fault is None else {"env": f"{FAIL_SYNC_ENV}={os.environ[FAIL_SYNC_ENV]}",
                                                      "version": fault},
        "setup_seconds_max": {n: max(v) for n, v in setup.items()},
        "speedup_vs_rank0": speedup.get(default) if default != "rank0" else 1.0,
        "speedup_vs_rank0_all": speedup,
        "wall_seconds": time.monotonic() - t0,
        **files,
    }
