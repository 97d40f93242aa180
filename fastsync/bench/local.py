"""Reference, in-process execution of a :class:`Plan` on real tensors.

``execute_plan_locally`` does in one process what the transports do across machines: owner
gathers, per-transfer slicing of the sender's local shard, the transform, and the write into the
receiver's engine tensor. ``reference_engine_tensors`` computes what every engine tensor must hold
straight from the full parameters, with no plan. Property tests compare the two bit for bit; the
executor uses both as its oracle.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from fastsync.errors import PlanError
from fastsync.executor.transforms import apply_transform, to_torch_dtype
from fastsync.layout.box import Box, box_numel, box_shape, box_slices
from fastsync.layout.types import EngineLayout, Shard, TrainerLayout
from fastsync.plan.replicate import expand
from fastsync.plan.types import Plan

__all__ = [
    "shard_view",
    "find_shard",
    "source_slice",
    "gather_full",
    "split_full_params",
    "execute_plan_locally",
    "reference_engine_tensors",
    "reference_digests",
    "write_counts",
]


def shard_view(local: torch.Tensor, shard: Shard) -> torch.Tensor:
    """The shard's elements in ``local`` (flat or shaped rank-local storage), shaped as its box."""
    n = box_numel(shard.box)
    flat = local.reshape(-1)
    if shard.local_offset + n > flat.numel():
        raise PlanError(
            f"rank {shard.rank}: local storage has {flat.numel()} elements, shard {shard.box} needs "
            f"{shard.local_offset + n}"
        )
    return flat[shard.local_offset: shard.local_offset + n].view(box_shape(shard.box))


def find_shard(shards: list[Shard] | tuple[Shard, ...], box: Box) -> Shard | None:
    """The shard among ``shards`` whose box contains ``box``, or None."""
    for sh in shards:
        if all(s0 <= b0 and b1 <= s1 for (s0, s1), (b0, b1) in zip(sh.box, box)):
            return sh
    return None


def source_slice(local: torch.Tensor, shard: Shard, box: Box) -> torch.Tensor:
    """``full[box]`` read from a rank's local storage of ``shard`` (a view, no copy)."""
    rel = tuple((b0 - s0, b1 - s0) for (b0, b1), (s0, _) in zip(box, shard.box))
    return shard_view(local, shard)[box_slices(rel)]


def gather_full(name: str, trainer: TrainerLayout, trainer_locals: Mapping[int, Mapping[str, torch.Tensor]]) -> torch.Tensor:
    """Reassemble parameter ``name`` from every shard (what an owner gather produces)."""
    spec = trainer.params[name]
    first = next(
        (trainer_locals[sh.rank][name] for sh in trainer.shards[name] if name in trainer_locals.get(sh.rank, {})),
        None,
    )
    if first is None:
        raise PlanError(f"no trainer rank holds local data of parameter {name!r}")
    full = torch.empty(spec.shape, dtype=first.dtype)
    for sh in trainer.shards[name]:
        if box_numel(sh.box):
            full[box_slices(sh.box)] = shard_view(trainer_locals[sh.rank][name], sh)
    return full


def split_full_params(full: Mapping[str, torch.Tensor], trainer: TrainerLayout) -> dict[int, dict[str, torch.Tensor]]:
    """Every trainer rank's flat local storage, as its shards lay it out (inverse of gathers)."""
    out: dict[int, dict[str, torch.Tensor]] = {}
    for name, shards in trainer.shards.items():
        t = full[name]
        sizes: dict[int, int] = {}
        for sh in shards:
            sizes[sh.rank] = max(sizes.get(sh.rank, 0), sh.local_offset + box_numel(sh.box))
        for rank, n in sizes.items():
            out.setdefault(rank, {})[name] = torch.zeros(n, dtype=t.dtype)
        for sh in shards:
            n = box_numel(sh.box)
            if n:
                out[sh.rank][name][sh.local_offset: sh.local_offset + n] = t[box_slices(sh.box)].reshape(-1)
    return out


def _empty_engine(engine: EngineLayout) -> dict[int, dict[str, torch.Tensor]]:
    return {
        rank: {n: torch.zeros(t.shape, dtype=to_torch_dtype(t.dtype)) for n, t in tensors.items()}
        for rank, tensors in engine.tensors.items()
    }


def _write(dst: torch.Tensor, dst_box: Box, value: torch.Tensor) -> None:
    dst[box_slices(dst_box)] = value.reshape(box_shape(dst_box))


def execute_plan_locally(
    plan: Plan,
    trainer_locals: Mapping[int, Mapping[str, torch.Tensor]],
    engine: EngineLayout,
    trainer: TrainerLayout | None = None,
) -> dict[int, dict[str, torch.Tensor]]:
    """Run ``plan``: gathers first, then every transfer from its sender's local storage.

    ``trainer_locals[rank][param]`` is that rank's local storage (flat or shaped) laid out by
    its shards. ``trainer`` (the layout the plan was built for) says where each shard sits in
    that storage; it is required and checked against the plan's hash.
    """
    if trainer is None:
        raise PlanError("execute_plan_locally needs the trainer layout to find shards in local storage")
    plan.check_layouts(trainer.fingerprint(), engine.fingerprint())
    out = _empty_engine(engine)
    shards_of: dict[tuple[int, str], list[Shard]] = {}
    for name, shards in trainer.shards.items():
        for sh in shards:
            shards_of.setdefault((sh.rank, name), []).append(sh)
    full = {name: gather_full(name, trainer, trainer_locals) for name in plan.gathers}
    direct, relays = expand(plan)
    for t in direct:
        if t.gathered:
            if plan.gathers.get(t.src_param) != t.src_rank:
                raise PlanError(f"transfer of {t.src_param!r} marked gathered but rank {t.src_rank} is not its owner")
            src = full[t.src_param][box_slices(t.src_box)]
        else:
            sh = find_shard(shards_of.get((t.src_rank, t.src_param), []), t.src_box)
            if sh is None:
                raise PlanError(f"trainer rank {t.src_rank} does not hold {t.src_param!r}{list(t.src_box)}")
            src = source_slice(trainer_locals[t.src_rank][t.src_param], sh, t.src_box)
        dst = out[t.dst_rank][t.dst_tensor]
        val = apply_transform(t.transform, src, dst.dtype)
        if val.numel() != box_numel(t.dst_box) or val.element_size() * val.numel() != t.nbytes:
            raise PlanError(f"transfer {t.src_param!r}{list(t.src_box)} -> rank {t.dst_rank} {t.dst_tensor!r}: "
                            f"{val.numel()} elements produced for box {t.dst_box}")
        _write(dst, t.dst_box, val)
    # relays after every direct write, hop by hop: a relay copies what landed on its source rank
    for r in sorted(relays, key=lambda r: r.hop):
        box = box_slices(r.transfer.dst_box)
        out[r.dst_rank][r.transfer.dst_tensor][box] = out[r.src_rank][r.transfer.dst_tensor][box]
    return out


def reference_engine_tensors(full_params: Mapping[str, torch.Tensor], engine: EngineLayout) -> dict[int, dict[str, torch.Tensor]]:
    """What each engine tensor must hold, computed piece by piece from the full parameters."""
    out = _empty_engine(engine)
    for rank, tensors in engine.tensors.items():
        for name, t in tensors.items():
            dst = out[rank][name]
            for p in t.pieces:
                _write(dst, p.dst_box, apply_transform(p.transform, full_params[p.src][box_slices(p.src_box)], dst.dtype))
    return out


def reference_digests(full_params: Mapping[str, torch.Tensor], tensors_json: dict) -> dict[str, str]:
    """What ``fastsync_digest`` must report for one engine rank whose tensors are ``tensors_json``
    (its ``describe()`` answer): :func:`~fastsync.executor.staging.tensor_digest` of each engine
    tensor built piece by piece from the full parameters (:func:`reference_engine_tensors`)."""
    from fastsync.executor.staging import tensor_digest
    from fastsync.layout.engine_json import engine_tensors_from_json

    want = reference_engine_tensors(full_params, EngineLayout(1, {0: engine_tensors_from_json(tensors_json)}))[0]
    return {n: tensor_digest(t) for n, t in want.items()}


def write_counts(plan: Plan, engine: EngineLayout) -> dict[int, dict[str, torch.Tensor]]:
    """How many transfers write each element of each engine tensor (all ones for a good plan)."""
    counts = {
        rank: {n: torch.zeros(t.shape, dtype=torch.int32) for n, t in tensors.items()}
        for rank, tensors in engine.tensors.items()
    }
    direct, relays = expand(plan)
    for t in direct + [r.transfer for r in relays]:
        counts[t.dst_rank][t.dst_tensor][box_slices(t.dst_box)] += 1
    return counts
