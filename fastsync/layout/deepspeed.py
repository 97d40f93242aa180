"""DeepSpeed ZeRO-3's local partitions, checked. Each rank holds ``param.ds_tensor``, the flat slice
``[r*ceil(n/N), (r+1)*ceil(n/N))`` of every parameter (the last rank's padded), which is exactly
the ``zero3:N`` layout: ``fastsync.layout.dtensor.trainer_layout_from_module`` (the builtin
``fastsync_trainer_layout`` hook) describes such a module, ``WeightSync``'s ``local_sources`` sends
from the partitions. Below stage 3 every rank holds every parameter whole (a plain module:
``replicated:N``, the planner splits the bytes among the ranks). Only the parameters' ``ds_*``
attributes are read: nothing imports DeepSpeed.
"""

from __future__ import annotations

from typing import Any

from fastsync.errors import LayoutError

__all__ = ["zero3_sources"]


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
