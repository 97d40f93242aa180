"""What an engine rank relays, and what reaches it by relay (plans with ``Plan.fanout``).

This program says, per origin trainer rank, which transfers an engine rank forwards to the same
rank of a child replica and which reach it by relay. The transport groups them into units it can
forward as soon as they landed (NIXL: one unit per trainer write batch into the chain's root rank,
``transport/nixl/relay.py``), so forwarding pipelines with the trainers' writes; the child counts
units from its upstream engine rank exactly as it counts write batches from trainer ranks.

Checksum keys: a relayed copy is checked against the trainer's checksum of the copy it wrote into
the chain's root replica (same bytes), so ``RecvItem.index`` of an incoming relayed item is that
root copy's flat index. Pure data, no transport.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fastsync.errors import PlanError
from fastsync.executor.recv_item import RecvItem
from fastsync.layout.box import box_numel
from fastsync.plan.types import Plan

__all__ = ["RelayProgram", "compile_relay"]


@dataclass(slots=True)
class RelayProgram:
    """One engine rank's relay duties. ``upstream``: the engine rank relaying into it (None when
    trainers write everything it holds). ``incoming``: origin trainer rank -> items that arrive by
    relay. ``children``: child engine rank -> origin -> items this rank forwards (its own
    regions, written at the same offsets on the child, whose tensors are identical)."""

    rank: int
    upstream: int | None = None
    root_rank: int = -1  # the rank of this chain's trainer-fed replica holding the same tensors
    num_transfers: int = 0  # transfers per replica: flat index % num_transfers is the planned transfer
    incoming: dict[int, list[RecvItem]] = field(default_factory=dict)
    children: dict[int, dict[int, list[RecvItem]]] = field(default_factory=dict)

    @property
    def forwarded_bytes(self) -> int:
        return sum(it.transfer.nbytes for units in self.children.values() for items in units.values() for it in items)

    @property
    def relayed_in_bytes(self) -> int:
        return sum(it.transfer.nbytes for items in self.incoming.values() for it in items)


def compile_relay(plan: Plan, rank: int, runs: dict[tuple[str, tuple], list[tuple[int, int]]] | None = None,
                  byte_runs_of=None) -> RelayProgram | None:  # type: ignore[no-untyped-def]
    """Relay duties of engine ``rank`` under ``plan`` (None when the plan has no relays).

    ``byte_runs_of(transfer) -> [(offset, nbytes)]`` gives a transfer's byte runs in its
    destination tensor (the receiver's tensor infos); ``runs`` is an optional cache."""
    f = plan.fanout
    if f is None or not plan.has_relays:
        return None
    e, n = f.replica_size, len(plan.transfers)
    if not 0 <= rank < f.replicas * e:
        raise PlanError(f"engine rank {rank} outside the plan's {f.replicas} replicas of {e}")
    k, j = divmod(rank, e)
    always = set(f.direct)
    roots = [k]
    while f.parents[roots[-1]] >= 0:
        roots.append(f.parents[roots[-1]])
    root = roots[-1]
    kids = [c for c, p in enumerate(f.parents) if p == k]
    prog = RelayProgram(rank, upstream=None if f.parents[k] < 0 else j + f.parents[k] * e, root_rank=j + root * e,
                        num_transfers=n)
    cache = runs if runs is not None else {}
    for i, t in enumerate(plan.transfers):
        if t.dst_rank != j or i in always:
            continue
        key = (t.dst_tensor, t.dst_box)
        dst_runs = cache.get(key)
        if dst_runs is None:
            dst_runs = cache[key] = byte_runs_of(t)
            if sum(nb for _, nb in dst_runs) != t.nbytes:
                raise PlanError(f"relay of {t.dst_tensor!r} box {t.dst_box} on engine rank {rank}: plan says "
                                f"{t.nbytes} bytes, the tensor's runs hold {sum(nb for _, nb in dst_runs)}")
        if prog.upstream is not None:
            prog.incoming.setdefault(t.src_rank, []).append(RecvItem(root * n + i, t, dst_runs))
        for c in kids:
            prog.children.setdefault(c * e + j, {}).setdefault(t.src_rank, []).append(
                RecvItem(c * n + i, t, dst_runs))
    assert all(box_numel(it.transfer.dst_box) > 0 for items in prog.incoming.values() for it in items)
    return prog
