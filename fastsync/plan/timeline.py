"""The simulator's schedule as events: what :func:`fastsync.plan.simulate.simulate` assumed, per
NIC, laid out in time (``simulate(..., on_event=callback)``).

The simulator is a fluid model and predicts one number; this module lays the same per-port
quantities out as a schedule, so a picture of it (``fastsync plan --trace``) ends where the
prediction does:

* ``sync`` track: ``first post`` (one ``per_transfer_s``), the whole ``predicted sync``, and
  ``start signal + completion`` (``sync_overhead_s``) at the end; a counter of NIC ports still busy.
* trainer rank r: ``NIC out`` carries its transfers in plan order (gathered parameters' sends
  last, not before its pulls ended) and the shards it sends to gather owners; a posting-bound rank
  runs slower (its ``transfers x per_transfer_s``); ``NIC in`` the shards it pulls as an owner;
  ``NVLink`` its intra-node gather traffic.
* engine rank r: ``NIC in`` receives its transfers back to back at the effective rate.

Transfers are grouped into at most ``max_slices`` slices per track (consecutive ones merged) so
a plan with millions of transfers still gives a file a browser opens.
Events are plain dicts: ``{"kind": "slice", "role", "rank", "thread", "name", "start_s", "dur_s",
"args"}`` and ``{"kind": "counter", "name", "t_s", "values"}``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from fastsync.plan.replicate import expand
from fastsync.plan.types import Plan

__all__ = ["emit_timeline", "SimEventCallback"]

SimEventCallback = Callable[[dict], None]


def _runs(on_event: SimEventCallback, role: str, rank: int, thread: str, items: Sequence[tuple[str, int]],
          start_s: float, rate: float, max_slices: int) -> float:
    """Lay ``(label, nbytes)`` items back to back from ``start_s`` at ``rate`` bytes/s, merging
    consecutive ones into at most ``max_slices`` slices; returns the end time."""
    total = sum(n for _, n in items)
    if not items or total <= 0:
        return start_s
    per = max(1, -(-len(items) // max_slices))
    t = start_s
    for i in range(0, len(items), per):
        group = items[i:i + per]
        nbytes = sum(n for _, n in group)
        dur = nbytes / rate
        name = group[0][0] if len(group) == 1 else f"{len(group)} transfers"
        on_event({"kind": "slice", "role": role, "rank": rank, "thread": thread, "name": name, "start_s": t,
                  "dur_s": dur, "args": {"bytes": nbytes, "transfers": len(group)}})
        t += dur
    return t


def emit_timeline(on_event: SimEventCallback, plan: Plan, *, bw: float, intra: float, per_transfer_s: float,
                  sync_overhead_s: float, predicted_s: float, posts: Sequence[int], out_nic: Sequence[int],
                  in_nic: Sequence[int], in_intra: Sequence[int], out_intra: Sequence[int],
                  gpus_per_node: int, max_slices: int = 64) -> None:
    """Emit the schedule behind one ``simulate`` call (its per-port byte counts and rates)."""
    t0 = per_transfer_s
    ends: list[float] = []
    sends: list[list[tuple[str, int]]] = [[] for _ in range(plan.num_trainers)]
    gathered: list[list[tuple[str, int]]] = [[] for _ in range(plan.num_trainers)]
    recvs: list[list[tuple[str, int]]] = [[] for _ in range(plan.num_receivers)]
    direct, relays = expand(plan)  # every copy of a fan-out plan (replicas planned once)
    for t in direct:
        label = f"{t.src_param} -> r{t.dst_rank}"
        (gathered if t.gathered else sends)[t.src_rank].append((label, t.nbytes))
        recvs[t.dst_rank].append((f"{t.dst_tensor} <- t{t.src_rank}", t.nbytes))
    for r in relays:  # relayed copies arrive on the engine rank's NIC like direct ones
        recvs[r.dst_rank].append((f"{r.transfer.dst_tensor} <- r{r.src_rank} (relay)", r.transfer.nbytes))
    for name, sources in plan.meta.get("gather_sources", {}).items():
        owner = plan.gathers[name]
        for src, nbytes in sources:
            if src // gpus_per_node != owner // gpus_per_node:
                sends[src].append((f"{name} shard -> owner t{owner}", nbytes))
    for r in range(plan.num_trainers):
        nic_bytes = sum(n for _, n in sends[r]) + sum(n for _, n in gathered[r])
        rate = bw
        if nic_bytes and posts[r] * per_transfer_s > nic_bytes / bw:  # posting-bound: WRITEs go out slower
            rate = nic_bytes / (posts[r] * per_transfer_s)
        end = _runs(on_event, "trainer", r, "NIC out", sends[r], t0, rate, max_slices)
        pull_end = t0
        if in_nic[r]:
            pull_end = max(pull_end, _runs(on_event, "trainer", r, "NIC in", [("gather: pull shards", in_nic[r])],
                                           t0, bw, max_slices))
        if in_intra[r] or out_intra[r]:
            nv = max(in_intra[r], out_intra[r])
            nv_end = _runs(on_event, "trainer", r, "NVLink", [("gather over NVLink", nv)], t0, intra, max_slices)
            ends.append(nv_end)
            if in_intra[r]:
                pull_end = max(pull_end, t0 + in_intra[r] / intra)
        if gathered[r]:
            end = _runs(on_event, "trainer", r, "NIC out", gathered[r], max(end, pull_end), rate, max_slices)
        ends += [end, pull_end]
    for r in range(plan.num_receivers):
        ends.append(_runs(on_event, "engine", r, "NIC in", recvs[r], t0, bw, max_slices))
    on_event({"kind": "slice", "role": "sync", "rank": 0, "thread": "phases", "name": "first post",
              "start_s": 0.0, "dur_s": per_transfer_s, "args": {}})
    data_end = max(ends, default=t0)
    on_event({"kind": "slice", "role": "sync", "rank": 0, "thread": "phases", "name": "start signal + completion",
              "start_s": data_end, "dur_s": sync_overhead_s, "args": {}})
    on_event({"kind": "slice", "role": "sync", "rank": 0, "thread": "total", "name": "predicted sync",
              "start_s": 0.0, "dur_s": predicted_s, "args": {"predicted_seconds": predicted_s}})
    ports = sorted(e for e in ends if e > t0)
    n = len(ports)
    on_event({"kind": "counter", "name": "ports busy (%)", "t_s": t0, "values": {"busy": 100.0 if n else 0.0}})
    for i, e in enumerate(ports):
        on_event({"kind": "counter", "name": "ports busy (%)", "t_s": e, "values": {"busy": 100.0 * (n - i - 1) / n}})
