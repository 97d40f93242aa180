"""Identical engine replicas: plan the first, replay it with rank offsets.

RL rollouts are often many identical engines (``vllm:tp1,replicas192``). Planning every replica
repeats the same work and makes plans (and per-rank programs) grow with the replica count. Here:

* :func:`replica_structure` finds ``R`` replicas of ``E`` consecutive engine ranks whose tensors
  are equal rank for rank (rank ``k * E + j`` holds what rank ``j`` holds);
* :func:`first_replica` is the engine layout of ranks ``0..E-1``, which the planner plans;
* :func:`expand` turns a plan with a :class:`~fastsync.plan.types.Fanout` into the flat writes
  every rank performs: trainer -> engine copies (:class:`~fastsync.plan.types.Transfer`, rank
  offset applied) and engine -> engine relays (:class:`Relay`). Only executors and tests expand;
  the planner, the simulator and ``fastsync plan`` count copies without building them.

Flat index of copy ``(i, k)`` (transfer ``i``, replica ``k``) is ``k * len(plan.transfers) + i``:
the key senders and receivers agree on for verification. Pure Python, no torch.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fastsync.layout.types import EngineLayout
from fastsync.plan.types import Plan, Transfer

__all__ = ["Relay", "replica_structure", "first_replica", "expand", "expand_indexed", "copy_index", "relay_sources", "relay_descendants",
           "sender_copies", "receiver_copies"]


@dataclass(frozen=True, slots=True)
class Relay:
    """Engine rank ``src_rank`` forwards copy ``index`` (flat) of ``transfer`` to engine rank
    ``dst_rank`` once its own copy ``src_index`` has landed. ``transfer`` is narrowed to the
    destination (``dst_rank`` offset); its ``dst_tensor``/``dst_box`` are the same on both ranks
    (replicas hold equal tensors), so the relay reads exactly the region it writes."""

    src_rank: int
    dst_rank: int
    index: int
    src_index: int
    transfer: Transfer
    hop: int  # 1 for a relay out of a trainer-fed replica, 2 for the next, ...


def replica_structure(engine: EngineLayout) -> tuple[int, int] | None:
    """``(E, R)`` when the engine ranks are ``R >= 2`` replicas of ``E`` consecutive ranks with equal
    tensors, else None. Uses ``replica_of`` when the layout names replicas; checks the tensors
    either way (identity first: builders share one dict between replicas)."""
    n = engine.world_size
    if n < 2 or len(engine.tensors) != n:
        return None
    if engine.replica_of and len(set(engine.replica_of.values())) > 1:
        size = sum(1 for r in range(n) if engine.replica_of.get(r) == engine.replica_of.get(0))
        candidates = [size] if size and n % size == 0 else []
    else:
        candidates = [e for e in range(1, n // 2 + 1) if n % e == 0]
    t = engine.tensors
    for e in candidates:
        ro = engine.replica_of
        if ro and (any(ro.get(r) != ro.get(r - r % e) for r in range(n))
                   or len({ro.get(k * e) for k in range(n // e)}) != n // e):
            continue  # replicas named otherwise than blocks of consecutive ranks
        if all(t[r] is t[r % e] or t[r] == t[r % e] for r in range(e, n)):
            return e, n // e
    return None


def first_replica(engine: EngineLayout, size: int) -> EngineLayout:
    """Engine ranks ``0..size-1`` as a layout of their own (what the planner plans)."""
    return EngineLayout(size, {r: engine.tensors[r] for r in range(size)},
                        {r: engine.replica_of.get(r, 0) for r in range(size)} if engine.replica_of else {},
                        kind=engine.kind, description=engine.description)


def copy_index(plan: Plan, i: int, k: int) -> int:
    """Flat index of copy ``(i, k)``."""
    return k * len(plan.transfers) + i


def expand(plan: Plan) -> tuple[list[Transfer], list[Relay]]:
    """Every trainer -> engine write (flat-indexed by position only when there is no fanout; use
    :func:`expand_indexed` for keys) and every relay, in replica order."""
    direct, relays = expand_indexed(plan)
    return [t for _, t in direct], relays


def expand_indexed(plan: Plan) -> tuple[list[tuple[int, Transfer]], list[Relay]]:
    """``([(flat index, trainer write)], [relay])`` of ``plan``."""
    f = plan.fanout
    if f is None:
        return list(enumerate(plan.transfers)), []
    n, e = len(plan.transfers), f.replica_size
    always = set(f.direct)
    direct: list[tuple[int, Transfer]] = []
    relays: list[Relay] = []
    depth = [f.depth(k) for k in range(f.replicas)]
    for k in range(f.replicas):
        parent = f.parents[k]
        for i, t in enumerate(plan.transfers):
            moved = t if k == 0 else dataclasses.replace(t, dst_rank=t.dst_rank + k * e)
            if parent < 0 or i in always:
                direct.append((k * n + i, moved))
            else:
                relays.append(Relay(t.dst_rank + parent * e, moved.dst_rank, k * n + i, parent * n + i, moved,
                                    depth[k]))
    return direct, relays


def sender_copies(plan: Plan, rank: int) -> list[tuple[int, Transfer]]:
    """``[(flat index, write)]`` trainer ``rank`` makes itself: O(its transfers x replicas it feeds),
    not the whole expanded plan (what ``compile_send`` needs), in the order it sends them.

    The replicas a rank feeds take turns transfer by transfer, starting at a replica that depends on
    the rank. Written replica by replica (all of replica 0, then all of replica 1), every trainer
    rank wrote into one replica's NIC at a time while the others idled: two peer holders feeding
    two chain roots took 18 s for 9.3 s of wire, each root receiving at line rate for half the time."""
    f = plan.fanout
    if f is None:
        return [(i, t) for i, t in enumerate(plan.transfers) if t.src_rank == rank]
    n, e = len(plan.transfers), f.replica_size
    always = set(f.direct)
    fed = [k for k in range(f.replicas) if f.parents[k] < 0]
    every = list(range(f.replicas))
    out = []
    for i, t in enumerate(plan.transfers):
        if t.src_rank != rank:
            continue
        ks = every if i in always else fed
        first = rank % len(ks)
        for k in ks[first:] + ks[:first]:
            out.append((k * n + i, t if k == 0 else dataclasses.replace(t, dst_rank=t.dst_rank + k * e)))
    return out


def receiver_copies(plan: Plan, rank: int) -> list[tuple[int, Transfer]]:
    """``[(flat index, write)]`` trainer ranks make into engine ``rank`` (relayed copies excluded):
    O(one replica's transfers), whatever the replica count (what ``compile_recv`` needs)."""
    f = plan.fanout
    if f is None:
        return [(i, t) for i, t in enumerate(plan.transfers) if t.dst_rank == rank]
    n, e = len(plan.transfers), f.replica_size
    k, j = divmod(rank, e)
    fed = f.parents[k] < 0
    always = set(f.direct)
    return [(k * n + i, t if k == 0 else dataclasses.replace(t, dst_rank=rank))
            for i, t in enumerate(plan.transfers) if t.dst_rank == j and (fed or i in always)]


def relay_sources(plan: Plan, engine_rank: int) -> list[int]:
    """Engine ranks that relay into ``engine_rank`` (empty when it is fed by trainers only)."""
    f = plan.fanout
    if f is None or not plan.has_relays:
        return []
    k = engine_rank // f.replica_size
    p = f.parents[k]
    return [] if p < 0 else [engine_rank - (k - p) * f.replica_size]


def relay_descendants(plan: Plan, engine_rank: int) -> list[int]:
    """Engine ranks fed, through relays, from ``engine_rank`` (the same rank of every replica down
    its chain; empty without relays or off a chain's root). With deltas they all apply the
    streams trainer ranks write into ``engine_rank``."""
    f = plan.fanout
    if f is None or not plan.has_relays:
        return []
    e = f.replica_size
    k, j = divmod(engine_rank, e)
    if f.parents[k] >= 0:
        return []
    out, frontier = [], [k]
    while frontier:
        frontier = [c for c, p in enumerate(f.parents) if p in frontier]
        out += [j + c * e for c in frontier]
    return sorted(out)
