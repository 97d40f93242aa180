"""The static plan of the buffered full-copy channel (:mod:`fastsync.host.fullcopy`): each
receiver rank gets a full copy of every tensor, under the names the host sends, into its own
registered buffer (a host's fallback when it cannot write into the engine's live weights: verl
with SGLang or without the worker extension). The trainer layout is either ``replicated:N`` (the
host handed every trainer rank the FULL tensors) or the trainer's own shards (e.g. FSDP2 DTensor
placements: each rank sends from its own shard, nothing is gathered). Both sides build the plan
from the same published inventory (names, shapes, dtypes in the host's order, plus the shards
when there are any), so it is identical everywhere; the sender's setup checks the plan hash."""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from fastsync.errors import ConfigError
from fastsync.executor.arena import carve_typed
from fastsync.executor.staging import dtype_name, torch_dtype
from fastsync.plan import Plan, build_plan
from fastsync.layout.box import box_shape, full_box
from fastsync.layout.trainer import replicated_layout
from fastsync.layout.types import Box, EngineLayout, EngineTensor, ParamSpec, Piece, Shard, TrainerLayout

__all__ = ["Inventory", "FullCopyPlan", "full_copy_engine_layout", "build_full_copy_plan", "inventory_from_json",
           "inventory_of", "flat_views", "send_boxes", "shard_views"]

Inventory = list[tuple[str, tuple[int, ...], str]]


def full_copy_engine_layout(params: dict[str, ParamSpec], num_receivers: int) -> EngineLayout:
    """Every receiver rank holds every parameter whole, under its own name (one replica each)."""
    tensors = {
        r: {n: EngineTensor(n, s.shape, s.dtype, (Piece(full_box(s.shape), n, full_box(s.shape)),))
            for n, s in params.items()}
        for r in range(num_receivers)
    }
    return EngineLayout(num_receivers, tensors, {r: r for r in range(num_receivers)}, kind="full-copy",
                        description=f"full copy x {num_receivers}")


@dataclass(slots=True)
class FullCopyPlan:
    inventory: Inventory
    params: dict[str, ParamSpec]
    trainer: TrainerLayout
    engine: EngineLayout
    plan: Plan
    sharded: bool = False

    def to_json(self) -> str:
        shards = ({n: [[s.rank, [list(b) for b in s.box], s.local_offset] for s in sh]
                   for n, sh in self.trainer.shards.items()} if self.sharded else None)
        return json.dumps({"inventory": [[n, list(s), d] for n, s, d in self.inventory], "shards": shards})


Shards = dict[str, tuple[Shard, ...]]


def inventory_from_json(raw: bytes | str) -> tuple[Inventory, Shards | None]:
    obj = json.loads(raw)
    inv = [(n, tuple(s), d) for n, s, d in obj["inventory"]]
    if obj.get("shards") is None:
        return inv, None
    return inv, {n: tuple(Shard(int(r), tuple((int(a), int(b)) for a, b in box), int(off)) for r, box, off in sh)
                 for n, sh in obj["shards"].items()}


def build_full_copy_plan(inventory: Inventory, num_trainers: int, num_receivers: int,
                    max_transfer_bytes: int | None, cap_bytes: int | None = None,
                    shards: Shards | None = None) -> FullCopyPlan:
    """``replicated:num_trainers`` (or the given FSDP2 ``shards``) -> full copy per receiver.
    ``max_transfer_bytes`` splits large tensors so the planner can spread one tensor's bytes over
    several trainer ranks; None picks 1/16 of a trainer rank's fair share (at most ``cap_bytes``,
    the host's bucket size), so a few equal large tensors still divide evenly."""
    if not inventory:
        raise ConfigError("the host sent no weights: nothing to plan")
    params: dict[str, ParamSpec] = {}
    for name, shape, dtype in inventory:
        if name in params:
            raise ConfigError(f"the host sent parameter {name!r} twice in one sync")
        params[name] = ParamSpec(name, tuple(shape), dtype)
    if max_transfer_bytes is None:
        share = sum(p.nbytes for p in params.values()) // (num_trainers * 16)
        max_transfer_bytes = max(4096, share if cap_bytes is None else min(share, cap_bytes))
    if shards is None:
        trainer = replicated_layout(params, num_trainers)
    else:
        missing = sorted(set(params) - set(shards))
        if missing:
            raise ConfigError(f"fastsync: no trainer shard of parameter {missing[0]!r} ({len(missing)} missing)")
        trainer = TrainerLayout(num_trainers, params, {n: tuple(shards[n]) for n in params}, kind="fsdp",
                                description="the trainer ranks' own shards")
        trainer.validate()
    engine = full_copy_engine_layout(params, num_receivers)
    plan = build_plan(params, trainer, engine, max_transfer_bytes=max_transfer_bytes)
    return FullCopyPlan(inventory, params, trainer, engine, plan, sharded=shards is not None)


def flat_views(specs: list[tuple[str, tuple[int, ...], str]]) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """One touched arena (registered once by the transport) carved into a shaped view per tensor
    (``executor.arena.carve_typed``, each view on a cache line of its own). Returns ``([arena], views)``:
    the arena is what keeps the views' memory alive."""
    arena, views = carve_typed(None, [(name, shape, torch_dtype(dtype)) for name, shape, dtype in specs])
    return [arena], views


def shard_views(trainer: TrainerLayout, rank: int) -> tuple[dict[str, Box], dict[str, torch.Tensor]]:
    """This rank's one shard box per parameter and a registered view for each (carved by
    :func:`flat_views`), for a host that copies its local shards in before every sync.
    ConfigError naming the parameter when a rank holds more than one shard of it."""
    mine = trainer.shards_on(rank)
    many = [n for n, sh in mine.items() if len(sh) != 1]
    if many:
        raise ConfigError(f"fastsync trainer rank {rank}: parameter {many[0]!r} has {len(mine[many[0]])} shards on "
                          "this rank; expected one (FSDP2 Shard(d))")
    boxes = {n: sh[0].box for n, sh in mine.items()}
    _, views = flat_views([(n, box_shape(b), trainer.params[n].dtype) for n, b in boxes.items()])
    return boxes, views


def send_boxes(plan: Plan, rank: int) -> dict[str, tuple[tuple[int, int], ...]]:
    """Per parameter ``rank`` sends from: the hull of its transfers' source boxes. A rank keeps
    only these regions of the host's full tensors (about its share, not the whole model)."""
    hull: dict[str, list[list[int]]] = {}
    for t in plan.transfers:
        if t.src_rank != rank:
            continue
        h = hull.get(t.src_param)
        if h is None:
            hull[t.src_param] = [[a, b] for a, b in t.src_box]
        else:
            for d, (a, b) in enumerate(t.src_box):
                h[d][0], h[d][1] = min(h[d][0], a), max(h[d][1], b)
    return {n: tuple((a, b) for a, b in h) for n, h in sorted(hull.items())}


def inventory_of(name: str, tensor: torch.Tensor) -> tuple[str, tuple[int, ...], str]:
    return name, tuple(tensor.shape), dtype_name(tensor.dtype)
