"""The simulator on a cluster whose processes share one NIC per host.

``simulate`` (``plan/simulate.py``) gives every rank its own NIC, as on a GPU cluster with one NIC
per GPU. A test cluster (``fastsync bench --hosts``: network namespaces, one shaped NIC each) puts
several processes behind one NIC, and traffic between processes of one host never touches it.
Here a :class:`HostMap` says which host each trainer and engine rank runs on, and:

* :func:`host_traffic` counts, per host, the bytes its NIC sends and receives for one sync of a
  plan (trainer -> engine copies, engine -> engine relays and owner gathers that cross hosts);
* :func:`simulate_on_hosts` predicts a sync: the busiest NIC port at ``efficiency`` x line rate,
  intra-host traffic at ``intra_gbps``, each sender's posting, the relay hops, plus
  ``sync_overhead_s`` (the version's control-plane round trips) and ``latency_ms`` per round trip;
* :func:`rank0_on_hosts` predicts the rank-0 baseline as fastsync's ``rank0`` transport runs it:
  trainer ranks send their shards of each bucket to trainer rank 0, which broadcasts the bucket
  over gloo, whose broadcast is a binomial tree without pipelining (``gloo/broadcast.cc``: in step
  ``i`` virtual rank ``v`` with bit ``i`` clear sends the whole buffer to ``v ^ 2**i``); buckets
  are double-buffered (the gather of ``b+1`` overlaps the broadcast of ``b``).

Pure Python: no torch, no transport.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from fastsync.errors import ConfigError
from fastsync.plan.replicate import expand
from fastsync.plan.simulate import gbps_to_bytes_per_s
from fastsync.plan.types import Plan

__all__ = ["HostMap", "host_traffic", "flow_bytes", "fair_share_seconds", "simulate_on_hosts", "rank0_on_hosts"]


@dataclass(frozen=True, slots=True)
class HostMap:
    """Host index of each trainer rank and each engine rank."""

    trainer_host: tuple[int, ...]
    engine_host: tuple[int, ...]

    @classmethod
    def spread(cls, trainers: int, rollouts: int, trainer_hosts: int, engine_hosts: int) -> "HostMap":
        """Trainer ranks in equal blocks over hosts ``0..T-1``, engine ranks over ``T..T+E-1``.
        ConfigError naming ``--hosts`` when a count does not divide its ranks."""
        for what, ranks, hosts in (("trainer", trainers, trainer_hosts), ("engine", rollouts, engine_hosts)):
            if hosts < 1 or ranks % hosts:
                raise ConfigError(f"--hosts: {hosts} {what} host(s) must be at least 1 and divide the {ranks} "
                                  f"{what} ranks")
        tp, ep = trainers // trainer_hosts, rollouts // engine_hosts
        return cls(tuple(r // tp for r in range(trainers)),
                   tuple(trainer_hosts + r // ep for r in range(rollouts)))

    @property
    def num_hosts(self) -> int:
        return max((*self.trainer_host, *self.engine_host), default=-1) + 1

    def placement(self) -> dict[tuple[str, int], int]:
        """``(role, rank) -> host`` (what ``fastsync.bench.harness.Cluster`` takes)."""
        out = {("trainer", r): h for r, h in enumerate(self.trainer_host)}
        out.update({("engine", r): h for r, h in enumerate(self.engine_host)})
        return out


@dataclass(frozen=True, slots=True)
class HostTraffic:
    egress: tuple[int, ...]  # bytes each host's NIC sends
    ingress: tuple[int, ...]
    intra: tuple[int, ...]  # bytes that stay inside each host (never touch its NIC)
    posts: tuple[int, ...]  # writes each trainer rank posts
    relay_hops: int
    biggest_relayed: int
    biggest_whole_relayed: int = 0  # the largest relayed transfer that cannot split (a quantised one)
    relayed_pair_bytes: int = 0  # the most one trainer rank writes into one relayed engine rank

    @property
    def cross_host_bytes(self) -> int:
        return sum(self.egress)


def host_traffic(plan: Plan, hosts: HostMap) -> HostTraffic:
    """Per-host NIC bytes of one sync of ``plan`` (every copy and relay expanded)."""
    if len(hosts.trainer_host) != plan.num_trainers or len(hosts.engine_host) != plan.num_receivers:
        raise ConfigError(f"host map has {len(hosts.trainer_host)} trainer and {len(hosts.engine_host)} engine ranks, "
                          f"the plan {plan.num_trainers} and {plan.num_receivers}")
    n = hosts.num_hosts
    eg, ig, intra = [0] * n, [0] * n, [0] * n
    posts = [0] * plan.num_trainers
    copies, relays = expand(plan)

    def move(a: int, b: int, nbytes: int) -> None:
        if a == b:
            intra[a] += nbytes
        else:
            eg[a] += nbytes
            ig[b] += nbytes

    for t in copies:
        move(hosts.trainer_host[t.src_rank], hosts.engine_host[t.dst_rank], t.nbytes)
        posts[t.src_rank] += 1
    for r in relays:
        move(hosts.engine_host[r.src_rank], hosts.engine_host[r.dst_rank], r.transfer.nbytes)
    for name, sources in plan.meta.get("gather_sources", {}).items():
        owner = plan.gathers[name]
        for src, nbytes in sources:
            move(hosts.trainer_host[src], hosts.trainer_host[owner], nbytes)
    hops = max((r.hop for r in relays), default=0)
    biggest = max((r.transfer.nbytes for r in relays), default=0)
    whole = max((r.transfer.nbytes for r in relays if r.transfer.transform != "copy"), default=0)
    pair: dict[tuple[int, int, int], int] = {}
    for r in relays:
        key = (r.transfer.src_rank, r.src_rank, r.dst_rank)
        pair[key] = pair.get(key, 0) + r.transfer.nbytes
    return HostTraffic(tuple(eg), tuple(ig), tuple(intra), tuple(posts), hops, biggest, whole,
                       max(pair.values(), default=0))


def flow_bytes(plan: Plan, hosts: HostMap) -> dict[tuple[int, int], tuple[int, int, int]]:
    """Trainer -> engine connections that cross hosts: ``(trainer rank, engine rank) -> (src host,
    dst host, bytes)`` of one sync (each such pair is one TCP connection or RDMA queue pair)."""
    out: dict[tuple[int, int], list[int]] = {}
    copies, _ = expand(plan)
    for t in copies:
        a, b = hosts.trainer_host[t.src_rank], hosts.engine_host[t.dst_rank]
        if a != b:
            out.setdefault((t.src_rank, t.dst_rank), [a, b, 0])[2] += t.nbytes
    return {k: (v[0], v[1], v[2]) for k, v in out.items()}


def fair_share_seconds(flows: list[tuple[int, int, int]], capacity: float) -> float:
    """When the last of ``flows`` (src host, dst host, bytes) ends if all start at once and share
    every host's egress and ingress of ``capacity`` bytes/s max-min fairly, as TCP connections
    do (progressive filling, re-run at each completion). Not the busiest port's bytes over the
    rate: a connection that ends early frees capacity the others cannot always use, since each
    is also held back at its other end."""
    left = [float(b) for _, _, b in flows]
    now = 0.0
    active = [i for i, b in enumerate(left) if b > 0]
    while active:
        rate = {i: 0.0 for i in active}
        cap = {}
        for i in active:
            a, b, _ = flows[i]
            cap.setdefault(("out", a), capacity)
            cap.setdefault(("in", b), capacity)
        unfixed = set(active)
        while unfixed:  # water-filling: raise every unfixed rate together until a port fills
            users: dict[tuple[str, int], list[int]] = {}
            for i in unfixed:
                a, b, _ = flows[i]
                users.setdefault(("out", a), []).append(i)
                users.setdefault(("in", b), []).append(i)
            port, share = min(((p, cap[p] / len(u)) for p, u in users.items()), key=lambda x: x[1])
            for i in unfixed:
                rate[i] += share
                a, b, _ = flows[i]
                cap[("out", a)] -= share
                cap[("in", b)] -= share
            unfixed -= set(users[port])  # the port is full: its connections are fixed
        dt = min(left[i] / rate[i] for i in active if rate[i] > 0)
        now += dt
        for i in active:
            left[i] -= rate[i] * dt
        active = [i for i in active if left[i] > 1e-6 * max(1.0, flows[i][2])]
    return now


def _check(nic_gbps: float, efficiency: float, intra_gbps: float) -> None:
    if not nic_gbps > 0 or not intra_gbps > 0:
        raise ConfigError(f"nic_gbps and intra_gbps must be positive, got {nic_gbps}, {intra_gbps}")
    if not 0 < efficiency <= 1:
        raise ConfigError(f"efficiency must be in (0, 1], got {efficiency}")


def simulate_on_hosts(plan: Plan, hosts: HostMap, *, nic_gbps: float, efficiency: float = 0.95,
                      intra_gbps: float = 40.0, cpu_gbps: float | None = None, per_transfer_s: float = 2e-6,
                      sync_overhead_s: float = 50e-6, latency_ms: float = 0.0, round_trips: int = 3,
                      relay_unit_bytes: int = 0, pack_seconds: Sequence[float] | None = None,
                      pack_chunks: Sequence[int] | None = None, fair_share: bool = True) -> dict:
    """Predicted seconds of one sync of ``plan`` on ``hosts`` (see the module docstring), with the
    terms it is made of. ``round_trips``: latency-bound exchanges per version (begin, done, flip).
    ``cpu_gbps``: where every host shares one machine's cores (a namespace cluster), the rate
    those cores move bytes through the network stack, for all hosts together (None: unlimited,
    as on a cluster of real machines whose NICs do the moving). ``relay_unit_bytes``: the most a
    relay forwards at once (it forwards what one trainer write batch completes, large transfers
    in pieces), so a hop costs one batch (no more than a trainer rank writes into the relaying rank,
    no less than a transfer that cannot split), once per trainer rank (their last batches land
    together and leave a relay together); 0 means whole transfers. ``pack_seconds[r]``: trainer rank ``r``'s
    packing compute (casts, FP8 quantisation) in ``pack_chunks[r]`` chunks; the first chunk is
    packed before anything is written, the rest overlaps the writes. ``fair_share``: the
    trainer -> engine connections share each host's NIC max-min fairly, as TCP does
    (:func:`fair_share_seconds`), rather than in the perfect schedule the busiest port alone
    would allow."""
    _check(nic_gbps, efficiency, intra_gbps)
    tr = host_traffic(plan, hosts)
    bw = gbps_to_bytes_per_s(nic_gbps) * efficiency
    intra_bw = gbps_to_bytes_per_s(intra_gbps)
    ports = [(max(e, i) / bw, h) for h, (e, i) in enumerate(zip(tr.egress, tr.ingress))]
    nic_s, busiest = max(ports, default=(0.0, -1))
    fair_s = fair_share_seconds(list(flow_bytes(plan, hosts).values()), bw) if fair_share else 0.0
    intra_s = max((b / intra_bw for b in tr.intra), default=0.0)
    posting_s = max(tr.posts, default=0) * per_transfer_s
    # each hop ends one unit per trainer rank after the previous one: the trainer ranks' last
    # batches land together (they share their hosts' NICs fairly), so the last hop carries them at once
    origins = len({t.src_rank for t in plan.transfers}) if tr.relay_hops else 0
    unit = 0
    if tr.relay_hops:
        unit = (max(min(relay_unit_bytes, tr.relayed_pair_bytes), tr.biggest_whole_relayed) if relay_unit_bytes
                else tr.biggest_relayed)
    relay_s = tr.relay_hops * (origins * unit / bw + per_transfer_s)
    latency_s = round_trips * 2 * latency_ms / 1e3
    cpu_s = (tr.cross_host_bytes + sum(tr.intra)) / gbps_to_bytes_per_s(cpu_gbps) if cpu_gbps else 0.0
    body = max(nic_s, fair_s, intra_s, posting_s, cpu_s)
    pack_s = 0.0
    if pack_seconds:
        chunks = list(pack_chunks or [1] * len(pack_seconds))
        pack_s = max(p / max(c, 1) + max(p * (max(c, 1) - 1) / max(c, 1), body)
                     for p, c in zip(pack_seconds, chunks)) - body
    body += pack_s
    bottleneck = ("trainer packing, then the NICs" if pack_s > 0.25 * body else
                  "posting" if body == posting_s and posting_s > 0 else
                  "the machine's CPUs (shared by every host)" if body == cpu_s and cpu_s > nic_s else
                  "intra-host copies" if body == intra_s and intra_s > nic_s else
                  "fair sharing of the NICs by the connections" if body == fair_s and fair_s > nic_s * 1.01 else
                  f"host {busiest} NIC")
    predicted = body + relay_s + per_transfer_s + sync_overhead_s + latency_s
    return {"predicted_seconds": predicted, "nic_seconds": nic_s, "intra_seconds": intra_s, "cpu_seconds": cpu_s, "fair_share_seconds": fair_s,
            "pack_seconds": pack_s,
            "posting_seconds": posting_s, "relay_seconds": relay_s, "latency_seconds": latency_s,
            "bottleneck": bottleneck, "cross_host_bytes": tr.cross_host_bytes,
            "egress_bytes": list(tr.egress), "ingress_bytes": list(tr.ingress)}


def rank0_on_hosts(buckets: Sequence[int], gather: Sequence[Mapping[int, int]], hosts: HostMap, *, nic_gbps: float,
                   efficiency: float = 0.95, intra_gbps: float = 40.0, cpu_gbps: float | None = None,
                   latency_ms: float = 0.0, sync_overhead_s: float = 50e-6) -> dict:
    """The ``rank0`` transport on ``hosts``: ``buckets[b]`` bytes broadcast per bucket,
    ``gather[b][r]`` the bytes trainer rank ``r`` sends trainer rank 0 for bucket ``b``. The
    broadcast group is trainer rank 0 then engine ranks ``0..R-1`` (group ranks ``0, 1..R``)."""
    _check(nic_gbps, efficiency, intra_gbps)
    bw = gbps_to_bytes_per_s(nic_gbps) * efficiency
    intra_bw = gbps_to_bytes_per_s(intra_gbps)
    cpu_bw = gbps_to_bytes_per_s(cpu_gbps) if cpu_gbps else float("inf")
    group = [hosts.trainer_host[0]] + list(hosts.engine_host)
    size = len(group)
    dim = max(1, (size - 1).bit_length())
    n = hosts.num_hosts
    cross = 0
    gather_s: list[float] = []
    bcast_s: list[float] = []

    def step_time(edges: list[tuple[int, int]], nbytes: int) -> tuple[float, int]:
        eg, ig, intra = [0] * n, [0] * n, [0] * n
        moved = 0
        for a, b in edges:
            if a == b:
                intra[a] += nbytes
            else:
                eg[a] += nbytes
                ig[b] += nbytes
                moved += nbytes
        t = max([max(e, i) / bw for e, i in zip(eg, ig)] + [x / intra_bw for x in intra]
                + [(moved + sum(intra)) / cpu_bw])
        return t, moved

    for b, nbytes in enumerate(buckets):
        h0 = hosts.trainer_host[0]
        eg, ig, intra = [0] * n, [0] * n, [0] * n
        for r, k in gather[b].items():
            if r == 0 or not k:
                continue
            a = hosts.trainer_host[r]
            if a == h0:
                intra[a] += k
            else:
                eg[a] += k
                ig[h0] += k
                cross += k
        gather_s.append(max([max(e, i) / bw for e, i in zip(eg, ig)] + [x / intra_bw for x in intra]
                            + [(sum(eg) + sum(intra)) / cpu_bw]))
        total = 0.0
        for i in range(dim):  # gloo's binomial tree, one whole buffer per step
            edges_i = []
            for v in range(size):
                if v & ~((1 << (i + 1)) - 1) or v & (1 << i):
                    continue  # v takes part in step i only once bits above i are clear; it sends if bit i is clear
                peer = v | (1 << i)
                if peer < size:
                    edges_i.append((group[v], group[peer]))
            t, moved = step_time(edges_i, nbytes)
            total += t + latency_ms / 1e3
            cross += moved
        bcast_s.append(total)
    g, c = sum(gather_s), sum(bcast_s)
    nb = max(1, len(buckets))
    predicted = max(g, c) + min(g, c) / nb + sync_overhead_s + 2 * latency_ms / 1e3
    return {"predicted_seconds": predicted, "gather_seconds": g, "broadcast_seconds": c, "buckets": len(buckets),
            "tree_steps": dim, "cross_host_bytes": cross}
