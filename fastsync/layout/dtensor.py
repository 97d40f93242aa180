"""Trainer layouts read from a live module's DTensor placements (FSDP2 ``fully_shard``, HSDP, TP)
and DeepSpeed ZeRO-3's partitions (a parameter with ``ds_tensor``: ``zero3:N``'s flat slices of
its ``ds_shape``; DeepSpeed is not imported).

Every rank can describe every other rank's holding: a DTensor knows its global shape, its device
mesh (the global rank at each mesh coordinate) and its placements, and ``Shard(d)`` splits with
``torch.chunk`` bounds, applied mesh dim by mesh dim. So one call on any rank returns the whole
:class:`TrainerLayout`; the builtin ``fastsync_trainer_layout`` hookimpl calls it.

Parameters are taken from ``module.state_dict()`` (its names are the HF names: FSDP2 does not
rename; persistent buffers such as DeepSeek's ``e_score_correction_bias`` and a tied
``lm_head.weight`` are included, as in the inventory). A plain tensor is a full replica on every
rank. ``Partial`` placements and strided shards (FSDP2 over TP) raise LayoutError naming the
parameter: their bytes are not a box of the full tensor.
"""

from __future__ import annotations

import itertools
from typing import Any

from fastsync.errors import LayoutError
from fastsync.layout.box import Box, chunk_bounds, full_box
from fastsync.layout.trainer import zero3_layout
from fastsync.layout.types import DTYPE_BYTES, ParamSpec, Shard, TrainerLayout

__all__ = ["trainer_layout_from_module", "dtensor_shards"]


def _dtype_name(t: Any) -> str:
    name = str(t.dtype).removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise LayoutError(f"dtype {name!r} not supported in layouts; known: {sorted(DTYPE_BYTES)}")
    return name


def dtensor_shards(name: str, t: Any) -> list[Shard]:
    """Every rank's box of DTensor ``t`` from its mesh and placements."""
    from torch.distributed.tensor import Replicate, Shard as DShard

    shape = tuple(int(n) for n in t.shape)
    mesh = t.device_mesh
    ranks = mesh.mesh  # tensor of global ranks, one dim per mesh dim
    placements = tuple(t.placements)
    out: list[Shard] = []
    for coord in itertools.product(*(range(n) for n in ranks.shape)):
        box = list(full_box(shape))
        for mesh_dim, pl in enumerate(placements):
            if type(pl) is DShard:
                d = pl.dim if pl.dim >= 0 else pl.dim + len(shape)
                lo, hi = box[d]
                a, b = chunk_bounds(hi - lo, ranks.shape[mesh_dim])[coord[mesh_dim]]
                box[d] = (lo + a, lo + b)
            elif isinstance(pl, Replicate):
                continue
            else:
                raise LayoutError(
                    f"parameter {name!r}: placement {pl!r} on mesh dim {mesh_dim} is not Shard(d)/Replicate; "
                    "its local bytes are not a box of the full tensor"
                )
        b: Box = tuple(box)
        if all(e > s for s, e in b) or not shape:
            out.append(Shard(int(ranks[coord]), b))
    return out


def trainer_layout_from_module(module: Any, rank: int, world_size: int) -> TrainerLayout:
    """The whole trainer layout of ``module`` (identical on every rank), validated.

    ``rank``/``world_size`` are the caller's trainer coordinates; every DTensor mesh rank must be
    below ``world_size``."""
    from torch.distributed.tensor import DTensor

    if not 0 <= rank < world_size:
        raise LayoutError(f"trainer rank {rank} outside world size {world_size}")
    params: dict[str, ParamSpec] = {}
    shards: dict[str, tuple[Shard, ...]] = {}
    kinds: set[str] = set()
    zero3: dict[str, ParamSpec] = {}  # DeepSpeed ZeRO-3 parameters: each rank a flat slice of the full ds_shape
    for name, t in module.state_dict(keep_vars=True).items():
        if hasattr(t, "ds_tensor"):
            kinds.add("zero3")
            params[name] = zero3[name] = ParamSpec(name, tuple(int(n) for n in t.ds_shape), _dtype_name(t))
            continue
        kinds.add(("hsdp" if t.device_mesh.ndim > 1 else "fsdp") if isinstance(t, DTensor) else "plain")
        shape = tuple(int(n) for n in t.shape)
        params[name] = ParamSpec(name, shape, _dtype_name(t))
        if isinstance(t, DTensor):
            got = dtensor_shards(name, t)
            bad = [s.rank for s in got if s.rank >= world_size]
            if bad:
                raise LayoutError(f"parameter {name!r}: DTensor mesh holds rank {bad[0]}, world size {world_size}")
            shards[name] = tuple(got)
        else:
            shards[name] = tuple(Shard(r, full_box(shape)) for r in range(world_size))
    if zero3:  # one zero3 layout for all of them (its boxes computed once per shape)
        shards.update(zero3_layout(zero3, world_size).shards)
        shards = {n: shards[n] for n in params}
    layout = TrainerLayout(world_size, params, shards, kind=kinds.pop() if len(kinds) == 1 else "dtensor",
                           description=f"from DTensor placements of {type(module).__name__}")
    layout.validate()
    return layout
