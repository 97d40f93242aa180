"""A trainer rank's local tensors: what :class:`~fastsync.sync.weight_sync.WeightSync` registers
and sends from, without copies, and :func:`where` their bytes are (checked again before each sync:
a tensor that moved must be registered again).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fastsync.errors import LayoutError

__all__ = ["local_sources", "where"]


def where(t: torch.Tensor) -> tuple[int, tuple[int, ...], torch.dtype]:
    """Where a registered tensor's bytes are: address, shape, dtype."""
    return t.data_ptr(), tuple(t.shape), t.dtype


def local_sources(module: torch.nn.Module, names: Sequence[str], *, rank: int = 0,
                  world_size: int = 1) -> dict[str, torch.Tensor]:
    """This rank's local tensor of each parameter: the DTensor's local shard (FSDP2: the memory
    the optimizer updates in place), a ZeRO-3 parameter's partition (``ds_tensor``, checked
    against ``zero3:world_size``) or the plain tensor itself. No copies."""
    from torch.distributed.tensor import DTensor

    from fastsync.layout.deepspeed import zero3_sources

    state = module.state_dict(keep_vars=True)
    out: dict[str, torch.Tensor] = {}
    for n in names:
        if n not in state:
            raise LayoutError(f"trainer model has no parameter {n!r}")
        t = state[n]
        if hasattr(t, "ds_tensor"):
            out.update(zero3_sources({n: t}, rank, world_size))
            continue
        local = t.to_local() if isinstance(t, DTensor) else t
        local = local.data if isinstance(local, torch.nn.Parameter) else local.detach()
        if not local.is_contiguous():
            raise LayoutError(f"trainer parameter {n!r}: local shard is not contiguous; cannot be sent without a copy")
        out[n] = local
    return out
