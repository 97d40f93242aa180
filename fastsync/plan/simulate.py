"""Link-level simulator: how long a plan (and the rank-0 broadcast baseline) takes on a cluster.

The model (one fluid, pipelined all-to-all; every assumption stated):

* Trainer and inference GPUs sit on different nodes (disaggregated RL); every transfer crosses
  the network. Each GPU has its own NIC of ``nic_gbps`` Gb/s, full duplex; the fabric is
  non-blocking (full bisection), so the only limits are the per-GPU NIC ports. For such a
  bipartite all-to-all a fluid schedule exists that finishes in max(port bytes) / bandwidth
  (Birkhoff-von Neumann), which pipelined one-sided WRITEs with many transfers in flight approach.
* Payload moves at ``efficiency`` x line rate (default 0.95: RDMA/RoCE headers at 4 KiB MTU and
  scheduling slack). The lower bound uses the raw line rate and payload bytes only.
* Owner gathers (``Plan.gathers``): the owner pulls every shard it lacks (``meta['gather_sources']``)
  before sending that parameter; pulls between GPUs of one node (``rank // gpus_per_node``) use
  ``intra_node_gbps`` (NVLink), others share the NIC with the sends. Intra-node pulls default to
  NIC speed when ``intra_node_gbps`` is None. An owner finishes no earlier than its gathers plus
  its gathered sends.
* Every transfer costs its sender ``per_transfer_s`` of posting (default 2 us: building and
  ringing one WRITE). Posting overlaps the DMA of earlier writes (the executor keeps many in
  flight), so a sender is busy for max(port bytes / bandwidth, transfers x per_transfer_s); one
  ``per_transfer_s`` (the first write, pipeline fill) and one ``sync_overhead_s`` (start signal +
  completion notification, default 50 us) are added once.

* Relays (``Plan.fanout``, ``plan/relay.py``): an engine rank forwarding copies to the next replica
  uses its NIC's egress (its port is max(in, out)). A relayed transfer cannot leave before it
  arrived: each hop of the deepest chain adds the largest relayed transfer's time plus
  ``per_transfer_s`` (store-and-forward per transfer, pipelined across transfers).

``predicted = max(busiest NIC port or posting-bound sender, owner gather->send chain,
intra-node gather time) + relay hops + per_transfer_s + sync_overhead_s``.

Bounds, all at raw line rate: ``lower_bound`` is this plan's busiest port; ``direct_bound`` the
busiest port when every replica is written straight from trainer ranks (the scheme without relays);
``physical_bound`` the busiest NIC under any schedule: the most bytes an engine rank must receive,
or an owner must send at least once (``meta['owner_unique_bytes']``: what only it holds).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass

from fastsync.errors import ConfigError
from fastsync.layout.types import ParamSpec
from fastsync.plan.types import Plan

__all__ = ["SimResult", "Rank0Result", "simulate", "rank0_baseline", "gbps_to_bytes_per_s"]


def gbps_to_bytes_per_s(gbps: float) -> float:
    return gbps * 1e9 / 8


def _check_bw(name: str, value: float | None) -> None:
    if value is not None and not value > 0:
        raise ConfigError(f"{name} must be positive, got {value}")


@dataclass(frozen=True, slots=True)
class SimResult:
    predicted_seconds: float
    lower_bound_seconds: float
    nic_seconds: float
    gather_seconds: float
    posting_seconds: float
    max_send_bytes: int
    max_recv_bytes: int
    mean_send_bytes: float
    mean_recv_bytes: float
    send_balance: float
    recv_balance: float
    bottleneck: str
    physical_bound_seconds: float = 0.0
    direct_bound_seconds: float = 0.0
    relay_seconds: float = 0.0
    relayed_bytes: int = 0
    max_relay_send_bytes: int = 0
    relay_hops: int = 0

    def to_json(self) -> dict:
        return asdict(self)


def _balance(values: list[int]) -> tuple[int, float, float]:
    if not values:
        return 0, 0.0, 1.0
    mx, mean = max(values), sum(values) / len(values)
    return mx, mean, (mx / mean if mean else 1.0)


def simulate(
    plan: Plan,
    *,
    nic_gbps: float,
    intra_node_gbps: float | None = None,
    gpus_per_node: int = 8,
    efficiency: float = 0.95,
    per_transfer_s: float = 2e-6,
    sync_overhead_s: float = 50e-6,
    on_event: Callable[[dict], None] | None = None,
) -> SimResult:
    """Predict one sync of ``plan``; see the module docstring for the model. ``on_event`` receives
    the schedule behind the prediction (``fastsync.plan.timeline``: slices per NIC, counters)."""
    _check_bw("nic_gbps", nic_gbps)
    _check_bw("intra_node_gbps", intra_node_gbps)
    if gpus_per_node <= 0 or not 0 < efficiency <= 1:
        raise ConfigError(f"gpus_per_node must be positive and efficiency in (0, 1], got {gpus_per_node}, {efficiency}")
    line = gbps_to_bytes_per_s(nic_gbps)
    bw = line * efficiency
    intra = gbps_to_bytes_per_s(intra_node_gbps) * efficiency if intra_node_gbps else bw

    send = plan.send_bytes()
    recv = plan.recv_bytes()
    n_tr = plan.num_trainers
    posts = [0] * n_tr
    gathered_send = [0] * n_tr
    f = plan.fanout
    roots = sum(1 for p in f.parents if p < 0) if f else 1
    always = set(f.direct) if f else set()
    reps = f.replicas if f else 1
    relay_out = [0] * plan.num_receivers  # bytes each engine rank forwards
    biggest_relayed = 0
    for i, t in enumerate(plan.transfers):
        copies = reps if i in always else roots
        posts[t.src_rank] += copies
        if t.gathered:
            gathered_send[t.src_rank] += t.nbytes * copies
        if copies < reps:
            relay_out[t.dst_rank] += t.nbytes  # per child replica, spread below
            biggest_relayed = max(biggest_relayed, t.nbytes)
    hops = 0
    if f is not None and biggest_relayed:
        e = f.replica_size
        base_out = relay_out[:e]
        children = [0] * f.replicas
        for k, par in enumerate(f.parents):
            if par >= 0:
                children[par] += 1
        relay_out = [base_out[r % e] * children[r // e] for r in range(plan.num_receivers)]
        hops = max(f.depth(k) for k in range(f.replicas))
    else:
        relay_out = [0] * plan.num_receivers

    out_nic = list(send)
    in_nic = [0] * n_tr
    in_intra = [0] * n_tr
    out_intra = [0] * n_tr
    for name, sources in plan.meta.get("gather_sources", {}).items():
        owner = plan.gathers[name]
        for src, nbytes in sources:
            if src // gpus_per_node == owner // gpus_per_node:
                out_intra[src] += nbytes
                in_intra[owner] += nbytes
            else:
                out_nic[src] += nbytes
                in_nic[owner] += nbytes

    port = [(max(out_nic[r], in_nic[r]) / bw, f"trainer rank {r} NIC") for r in range(n_tr)]
    port += [(max(recv[r], relay_out[r]) / bw, f"engine rank {r} NIC" + (" in" if recv[r] >= relay_out[r] else " out"))
             for r in range(plan.num_receivers)]
    nic_s, bottleneck = max(port, key=lambda x: x[0]) if port else (0.0, "none")
    posting_s = max(posts, default=0) * per_transfer_s
    if posting_s > nic_s:
        nic_s, bottleneck = posting_s, f"posting on trainer rank {posts.index(max(posts))}"
    gather_s = max((max(in_intra[r], out_intra[r]) / intra for r in range(n_tr)), default=0.0)
    chain_s = 0.0
    for r in range(n_tr):
        if gathered_send[r]:
            pull_s = max(in_intra[r] / intra, in_nic[r] / bw)
            chain_s = max(chain_s, pull_s + gathered_send[r] / bw)
    if chain_s > nic_s and chain_s >= gather_s:
        bottleneck = "owner gather then send"
    elif gather_s > nic_s:
        bottleneck = "intra-node gathers"
    relay_s = hops * (biggest_relayed / bw + per_transfer_s)
    predicted = max(nic_s, gather_s, chain_s) + relay_s + per_transfer_s + sync_overhead_s
    if on_event is not None:
        from fastsync.plan.timeline import emit_timeline

        emit_timeline(on_event, plan, bw=bw, intra=intra, per_transfer_s=per_transfer_s, sync_overhead_s=sync_overhead_s,
                      predicted_s=predicted, posts=posts, out_nic=out_nic, in_nic=in_nic, in_intra=in_intra,
                      out_intra=out_intra, gpus_per_node=gpus_per_node)

    smax, smean, sbal = _balance(send)
    rmax, rmean, rbal = _balance(recv)
    lower = max(smax, rmax, max(relay_out, default=0)) / line
    direct_send = [0] * n_tr
    for t in plan.transfers:
        direct_send[t.src_rank] += t.nbytes * reps
    direct = max(max(direct_send, default=0), rmax) / line
    physical = max(max(plan.meta.get("owner_unique_bytes") or [0]), rmax) / line
    relayed = sum(relay_out)
    return SimResult(predicted, lower, nic_s, max(gather_s, chain_s), posting_s, smax, rmax, smean, rmean, sbal, rbal,
                     bottleneck, physical, direct, relay_s, relayed, max(relay_out, default=0), hops)


@dataclass(frozen=True, slots=True)
class Rank0Result:
    predicted_seconds: float
    gather_seconds: float
    broadcast_seconds: float
    model_bytes: int
    num_buckets: int
    assumption: str

    def to_json(self) -> dict:
        return asdict(self)


def rank0_baseline(
    params: Mapping[str, ParamSpec],
    num_receivers: int,
    *,
    nic_gbps: float,
    num_trainers: int,
    intra_node_gbps: float | None = None,
    gpus_per_node: int = 8,
    num_groups: int = 1,
    bucket_bytes: int = 512 << 20,
    efficiency: float = 0.95,
    hop_latency_s: float = 20e-6,
    overlap: bool = True,
) -> Rank0Result:
    """The "gather on trainer rank 0, broadcast to every engine rank" design, modelled on
    verl's NCCL checkpoint engine (``verl/checkpoint_engine/nccl_checkpoint_engine.py``):

    * tensors are all-gathered (``full_tensor()``) in the trainer dtype and packed into buckets of
      ``bucket_bytes``; rank 0 receives (N-1)/N of each bucket: the share of the other
      ``gpus_per_node - 1`` GPUs of its node over NVLink (``intra_node_gbps``), the rest through
      its NIC;
    * each bucket is broadcast from trainer rank 0 over one NCCL group holding every inference
      rank, a pipelined ring/tree whose rate is rank 0's NIC: rank 0 sends each byte once per
      broadcast group (``num_groups`` > 1 models one broadcast per replica), plus a tree depth of
      ``hop_latency_s`` per bucket;
    * verl double-buffers: the gather of bucket b+1 overlaps the broadcast of bucket b
      (``overlap=True``), so the time is the slower stream plus one bucket of the other;
      ``overlap=False`` runs them one after the other.

    Receivers quantise to FP8 themselves, so the wire carries the trainer dtype. The assumption
    favours the baseline: no per-bucket host overhead and a perfect ring."""
    _check_bw("nic_gbps", nic_gbps)
    _check_bw("intra_node_gbps", intra_node_gbps)
    bw = gbps_to_bytes_per_s(nic_gbps) * efficiency
    intra = gbps_to_bytes_per_s(intra_node_gbps) * efficiency if intra_node_gbps else bw
    model = sum(p.nbytes for p in params.values())
    n = max(1, num_trainers)
    local = min(gpus_per_node, n)
    gather_s = model * (n - local) / n / bw + model * (local - 1) / n / intra
    buckets = max(1, math.ceil(model / bucket_bytes))
    depth = max(1, math.ceil(math.log2(num_receivers + 1)))
    bcast_s = num_groups * model / bw + buckets * depth * hop_latency_s
    if overlap:
        total = max(gather_s, bcast_s) + min(gather_s, bcast_s) / buckets
        how = "double-buffered"
    else:
        total = gather_s + bcast_s
        how = "serially"
    assumption = (
        f"rank 0 all-gathers {bucket_bytes >> 20} MiB buckets and broadcasts each to {num_receivers} receivers "
        f"({num_groups} broadcast group(s)), {how}, at {nic_gbps:g} Gb/s x {efficiency:g}"
    )
    return Rank0Result(total, gather_s, bcast_s, model, buckets, assumption)
