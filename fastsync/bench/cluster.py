"""``fastsync bench --hosts T:E``: the benchmark on a cluster of network-namespace hosts.

Trainer ranks run on hosts ``0..T-1`` and engine ranks on ``T..T+E-1`` (``HostMap.spread``), each
host with one NIC shaped to ``--nic-gbps`` (``fastsync.bench.netns_cluster``), NIXL held to TCP on it, the
control store on host 0's address. What this adds to ``run_bench``'s result:

* ``nic_bytes`` per transport: the bytes every NIC sent during one sync (median over the timed
  versions), counted by the kernel on the veths. The parent holds each version at its barrier
  until it has read the counters (``WorkerConfig.gate``), so a version's bytes are its own;
* ``planned_cross_host_bytes``: what the plan (``plan.shared_nic.host_traffic``) or the rank-0 model
  (``plan.shared_nic.rank0_on_hosts``) says must cross a NIC;
* ``predicted_seconds`` and ``prediction_error``: the simulator on the same cluster (hosts, NIC
  rate, processes per host), with the link's efficiency and the intra-host rate measured once on
  this rig (``calibrate``: one TCP stream through a NIC, one over a host's loopback), not fitted
  to the benchmark.
"""

from __future__ import annotations

import socket
import statistics
import threading
import time
from typing import Any

from fastsync.bench.netns_cluster import MAX_NIC_GBPS, HostRig
from fastsync.bench.model import BenchModel
from fastsync.bench.workers import gate_key
from fastsync.errors import ConfigError, SyncError
from fastsync.layout.box import box_numel
from fastsync.layout.types import DTYPE_BYTES
from fastsync.plan.shared_nic import HostMap, rank0_on_hosts, simulate_on_hosts

__all__ = ["calibrate", "rank0_buckets", "predict", "gated_collect"]

_PROBE_BYTES = 48 << 20
_REPEATS = 5  # medians: these machines are shared


def _streams(rig: HostRig, pairs: list[tuple[int, int]], nbytes: int) -> float:
    """Seconds for ``nbytes`` to cross each ``(src host, dst host)`` pair, all at once, one TCP
    connection each (from the first byte sent to the last byte received)."""
    servers, conns = [], []
    for src, dst in pairs:
        with rig.entered(dst):
            servers.append(socket.create_server((rig.addr(dst), 0)))
    done: list[float] = []
    lock = threading.Lock()

    def serve(srv: socket.socket) -> None:
        conn, _ = srv.accept()
        n, buf = 0, bytearray(1 << 20)
        while n < nbytes:
            k = conn.recv_into(buf)
            if not k:
                break
            n += k
        with lock:
            done.append(time.perf_counter())
        conn.close()

    threads = [threading.Thread(target=serve, args=(srv,), daemon=True) for srv in servers]
    for th in threads:
        th.start()
    for (src, dst), srv in zip(pairs, servers):
        with rig.entered(src):
            conns.append(socket.create_connection((rig.addr(dst), srv.getsockname()[1]), timeout=30))
    payload = b"\0" * (1 << 20)

    def push(c: socket.socket) -> None:
        for _ in range(nbytes >> 20):
            c.sendall(payload)

    t0 = time.perf_counter()
    senders = [threading.Thread(target=push, args=(c,), daemon=True) for c in conns]
    for th in senders:
        th.start()
    for th in senders + threads:
        th.join(120)
    for c in conns + servers:
        c.close()
    if len(done) != len(pairs):
        raise SyncError("host rig calibration: a probe stream did not finish")
    return max(done) - t0


def calibrate(rig: HostRig, pairs: list[tuple[int, int]] | None = None, packers: int = 1) -> dict[str, Any]:
    """Measured once per rig, with TCP streams like the sync's (medians of 5):

    * ``efficiency``: what the sync's connections achieve together through the NICs, as a share
      of the line rate: one stream per ``pairs`` entry (``(src host, dst host)``, one per trainer
      rank -> engine rank connection, repeats allowed), equal bytes each, against the time the
      busiest NIC port would take at line rate;
    * ``efficiency_one_stream``: the same for a single stream;
    * ``intra_gbps``: one stream over a host's loopback;
    * ``pack_bytes_per_s``: one packer's rate per transform while ``packers`` (the sync's trainer
      ranks) pack at once on this machine's cores (:func:`pack_rates`);
    * ``cpu_gbps``: what this machine's CPUs move through the kernel's TCP stack and the veths over
      ``pairs`` at once with the NIC limit lifted: on a rig every host shares the same few cores,
      which a real cluster's NICs do not.
    """
    far = 1 if len(rig.hosts) > 1 else 0
    med = statistics.median
    line = rig.nic_gbps * 1e9 / 8
    one = min(1.0, med(_PROBE_BYTES / line / _streams(rig, [(far, 0)], _PROBE_BYTES) for _ in range(_REPEATS)))
    pairs = pairs or [(far, 0)]
    each = max(_PROBE_BYTES // len(pairs), 4 << 20)
    port: dict[tuple[str, int], int] = {}
    for a, b in pairs:
        port[("out", a)] = port.get(("out", a), 0) + each
        port[("in", b)] = port.get(("in", b), 0) + each
    fluid = max(port.values()) / line
    eff = min(1.0, med(fluid / _streams(rig, pairs, each) for _ in range(_REPEATS)))
    intra = med(_PROBE_BYTES * 8 / _streams(rig, [(0, 0)], _PROBE_BYTES) / 1e9 for _ in range(_REPEATS))
    rate = rig.nic_gbps
    rig.set_rate(MAX_NIC_GBPS)
    try:
        cpu = med(len(pairs) * each * 8 / _streams(rig, pairs, each) / 1e9 for _ in range(_REPEATS))
    finally:
        rig.set_rate(rate)
    out: dict[str, Any] = {"efficiency": eff, "efficiency_one_stream": one, "intra_gbps": intra, "cpu_gbps": cpu}
    out["pack_bytes_per_s"] = pack_rates(packers)  # before the workers start: a quiet machine
    out["packers"] = packers
    return out


def rank0_buckets(model: BenchModel, bucket_bytes: int) -> tuple[list[int], list[dict[int, int]]]:
    """Buckets as the ``rank0`` transport forms them (``_plan_buckets``: full tensors in plan
    order, a new bucket when the next would overflow, 64-byte aligned) and, per bucket, the bytes
    each trainer rank sends trainer rank 0 (replicated shards: the lowest rank)."""
    read = list(dict.fromkeys(t.src_param for t in model.plan.transfers))
    sizes: list[int] = []
    gather: list[dict[int, int]] = []
    cur = -1
    for p in read:
        spec = model.params[p]
        n = spec.nbytes
        if cur < 0 or (sizes[cur] + n > bucket_bytes and sizes[cur]):
            sizes.append(0)
            gather.append({})
            cur += 1
        seen: set = set()
        for sh in sorted(model.trainer.shards[p], key=lambda s: s.rank):
            if sh.box in seen:
                continue
            seen.add(sh.box)
            gather[cur][sh.rank] = gather[cur].get(sh.rank, 0) + box_numel(sh.box) * DTYPE_BYTES[spec.dtype]
        sizes[cur] += -(-n // 64) * 64
    return sizes, gather


def pack_rates(packers: int = 1) -> dict[str, float]:
    """Source bytes per second one packer packs, per transform, while ``packers`` pack at once
    (one thread each, on a 16 MiB bf16 tensor, median of 7 rounds): the trainer's CPU-bound part
    of a sync that needs casts or FP8. On a host rig every trainer rank packs on the same few
    cores; whether they slow each other down depends on the CPU (on an Intel machine with AMX four
    FP8 packers on two cores went as fast as one; on an AMD EPYC without it each went at a
    third of one's rate), so it is measured with as many packers as the sync has trainer ranks, not assumed."""
    import torch

    from fastsync.executor.pack import transform_into
    from fastsync.plugins import transforms

    if packers < 1:
        raise ConfigError(f"pack_rates: packers must be at least 1, got {packers}")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        src = torch.randn(4096, 2048, dtype=torch.bfloat16)
        rates = {}
        for name in sorted(transforms()):
            if name == "copy":
                continue
            try:
                reg = transforms()[name]
                size = reg.obj(src, torch.float8_e4m3fn).contiguous().view(torch.uint8).numel()
            except Exception:  # a transform that does not apply to this probe: not modelled
                continue
            outs = [torch.empty(size, dtype=torch.uint8) for _ in range(packers)]
            times: list[float] = []
            failed: list[BaseException] = []
            lock = threading.Lock()
            start = threading.Barrier(packers)

            def one(out: torch.Tensor, name: str = name) -> None:
                start.wait()
                try:
                    for _ in range(7):
                        t0 = time.perf_counter()
                        transform_into(out, src, name, "float8_e4m3fn")
                        dt = time.perf_counter() - t0
                        with lock:
                            times.append(dt)
                except Exception as e:  # handed to the caller: the transform is then not modelled
                    failed.append(e)

            threads = [threading.Thread(target=one, args=(o,), daemon=True) for o in outs]
            for th in threads:
                th.start()
            for th in threads:
                th.join(120)
            if failed:  # a transform that does not apply to this probe: not modelled
                continue
            if any(th.is_alive() for th in threads):
                raise SyncError(f"host rig calibration: packing probe {name!r} did not finish in 120 s")
            rates[name] = src.numel() * src.element_size() / statistics.median(times)
        return rates
    finally:
        torch.set_num_threads(before)


def pack_estimate(model: BenchModel, rates: dict[str, float], slot_bytes: int) -> tuple[list[float], list[int]]:
    """Per trainer rank: seconds of packing (its transformed sources at the measured per-packer
    rate) and the chunks it is cut into. ``rates`` are per packer with every trainer rank packing
    at once (:func:`pack_rates`), so contention for the machine's cores is in them."""
    from fastsync.plan.replicate import sender_copies

    secs, chunks = [], []
    for r in range(model.plan.num_trainers):
        t_s, staged = 0.0, 0
        for _, t in sender_copies(model.plan, r):
            if t.transform == "copy" or t.transform not in rates:
                continue
            src = box_numel(t.src_box) * DTYPE_BYTES[model.params[t.src_param].dtype]
            t_s += src / rates[t.transform]
            staged += t.nbytes
        secs.append(t_s)
        chunks.append(max(1, -(-staged // slot_bytes)))
    return secs, chunks


def predict(model: BenchModel, hosts: HostMap, transports: list[str], *, nic_gbps: float, latency_ms: float,
            cal: dict[str, Any], rank0_bucket_bytes: int, staging_bytes: int = 256 << 20,
            num_slots: int = 2) -> dict[str, dict[str, Any]]:
    """Per transport: the simulator's prediction on this cluster and the bytes it plans across NICs."""
    from fastsync.sync.sender import RELAY_CHUNK_BYTES

    out: dict[str, dict[str, Any]] = {}
    rates = cal.get("pack_bytes_per_s") or {} if any(t.transform != "copy" for t in model.plan.transfers) else {}
    slot = staging_bytes // num_slots
    if model.plan.has_relays:
        slot = min(slot, RELAY_CHUNK_BYTES)
    pack_s, chunks = pack_estimate(model, rates, slot) if rates else (None, None)
    for name in transports:
        if name == "rank0":
            sizes, gather = rank0_buckets(model, rank0_bucket_bytes)
            got = rank0_on_hosts(sizes, gather, hosts, nic_gbps=nic_gbps, efficiency=cal["efficiency"],
                                 intra_gbps=cal["intra_gbps"], cpu_gbps=cal.get("cpu_gbps"), latency_ms=latency_ms)
        else:
            got = simulate_on_hosts(model.plan, hosts, nic_gbps=nic_gbps, efficiency=cal["efficiency"],
                                    intra_gbps=cal["intra_gbps"], cpu_gbps=cal.get("cpu_gbps"), latency_ms=latency_ms,
                                    relay_unit_bytes=RELAY_CHUNK_BYTES if model.plan.has_relays else 0,
                                    pack_seconds=pack_s, pack_chunks=chunks)
        out[name] = got
    return out


def _tx_total(rig: HostRig) -> int:
    return sum(rig.nic_bytes(i)[0] for i in range(len(rig.hosts)))


def gated_collect(cluster: Any, schedule: list[tuple[str, int, bool]], num_procs: int, timeout_s: float,
                  on_row: Any = None) -> dict[int, int]:
    """Let each version through its barrier only after reading every NIC's counters, and read them
    again once all its rows arrived; returns the bytes the NICs sent per version. Then waits for
    every worker's exit row."""
    rig = cluster.rig
    ctl = cluster.control  # the workers' prefix
    per_version: dict[int, int] = {}
    deadline = time.monotonic() + timeout_s
    for name, v, _ in schedule:
        before = _tx_total(rig)
        ctl.set(gate_key(name, v), b"1")

        def done(rows: list[dict], v: int = v) -> bool:
            return sum(r.get("kind") == "sync" and r.get("version") == v for r in rows) >= num_procs

        cluster.collect(done, timeout_s=max(deadline - time.monotonic(), 1.0), on_row=on_row)
        per_version[v] = _tx_total(rig) - before
    cluster.collect(lambda rs: sum(r.get("kind") == "exit" for r in rs) == num_procs,
                    timeout_s=max(deadline - time.monotonic(), 1.0), on_row=on_row)
    return per_version


def nic_summary(per_version: dict[int, int], schedule: list[tuple[str, int, bool]], warmup: int) -> dict[str, int]:
    """Median NIC bytes per sync of each transport, over its timed (non-warm-up, unverified) versions."""
    by: dict[str, list[int]] = {}
    seen: dict[str, int] = {}
    for name, v, verify in schedule:
        seen[name] = seen.get(name, 0) + 1
        if seen[name] > warmup and not verify and v in per_version:
            by.setdefault(name, []).append(per_version[v])
    return {n: int(statistics.median(xs)) for n, xs in by.items() if xs}
