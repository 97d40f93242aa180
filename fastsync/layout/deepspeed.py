"""Trainer layouts read from a live DeepSpeed module's parameters, as ``dtensor`` reads FSDP2's.

Under ZeRO-3 each rank holds ``param.ds_tensor``, the flat slice ``[r*ceil(n/N), (r+1)*ceil(n/N))``
of every parameter (the last rank's padded), which is exactly the ``zero3:N`` layout; under
ZeRO-0/1/2 every rank holds every parameter whole (``replicated:N``: the planner splits the bytes
among the ranks). Only the parameters' ``ds_*`` attributes are read: nothing imports DeepSpeed.
"""

from __future__ import annotations

from typing import Any

from fastsync.errors import ConfigError, LayoutError
from fastsync.layout.trainer import replicated_layout, zero3_layout
from fastsync.layout.types import ParamSpec, TrainerLayout

__all__ = ["deepspeed_layout", "zero3_sources"]


def _dtype(t: Any) -> str:
    return str(t.dtype).removeprefix("torch.")


def zero3_sources(params: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    """Each ZeRO-3 parameter's local partition (``param.ds_tensor``), checked against the
    ``zero3:N`` partitioning before it is planned on: LayoutError naming the parameter and rank."""
    out: dict[str, Any] = {}
    for name, p in params.items():
        part = getattr(p, "ds_tensor", None)
        if part is None:
            raise LayoutError(f"trainer rank {rank}: parameter {name!r} is not a ZeRO-3 parameter (no ds_tensor)")
        numel = int(p.ds_numel)
        want = -(-numel // world_size)
        if part.dim() != 1 or part.numel() != want or not part.is_contiguous():
            raise LayoutError(f"trainer rank {rank}: parameter {name!r} partition has {tuple(part.shape)}, expected a "
                              f"contiguous [{want}] (ceil({numel}/{world_size})): not DeepSpeed ZeRO-3's flat layout")
        out[name] = part.data
    return out


def deepspeed_layout(module: Any, rank: int, world_size: int, zero_stage: int) -> tuple[TrainerLayout, dict[str, Any]]:
    """``(layout, sources)`` of a DeepSpeed-wrapped ``module`` (``engine.module``) on ``rank``:
    ``zero3:N`` over the ``ds_tensor`` partitions at stage 3, ``replicated:N`` over the whole
    parameters below it. The sources are the live memory the optimizer updates, no copies."""
    if zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"ZeRO stage must be 0-3, got {zero_stage}")
    params = dict(module.named_parameters())
    if zero_stage == 3:
        specs = {n: ParamSpec(n, tuple(int(d) for d in p.ds_shape), _dtype(p)) for n, p in params.items()}
        return zero3_layout(specs, world_size), zero3_sources(params, rank, world_size)
    specs = {n: ParamSpec(n, tuple(p.shape), _dtype(p)) for n, p in params.items()}
    return replicated_layout(specs, world_size), {n: p.data for n, p in params.items()}
