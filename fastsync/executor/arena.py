"""One arena, carved into views: many tensors in one allocation, so memory is touched once at
set-up and registered with the transport once instead of once per tensor.

Used by the engine side for its staging tensors, the in-place snapshot and the staged flip's
copy (``engines/vllm/worker_state.py``, ``reload.py``) and the fallback buffers (``fallback.py``),
by the delta sender for its base copies (``sync/delta_sender.py``, on the trainer's device) and by
the host kit's full-copy channel for its typed buffers (``host/fullcopy_plan.flat_views``).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TypeVar

import torch

from fastsync.executor.staging import alloc_touched

__all__ = ["CACHE_LINE", "arena_bytes", "carve", "carve_typed", "nbytes_of"]

#: The alignment of the engine side's views: a cache line, so no two tensors share one.
CACHE_LINE = 64

K = TypeVar("K", bound=Hashable)


def _up(n: int, align: int) -> int:
    return -(-n // align) * align


def nbytes_of(shape: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes of a dense tensor of ``shape`` and ``dtype``."""
    return int(torch.Size(shape).numel()) * torch.empty(0, dtype=dtype).element_size()


def arena_bytes(sizes: Sequence[int], align: int = 1) -> int:
    """The arena :func:`carve` needs for ``sizes`` bytes, each starting at a multiple of ``align``
    (at least 1 byte, so an empty arena is still a tensor)."""
    return max(sum(_up(int(n), align) for n in sizes), 1)


def carve(arena: torch.Tensor | None, spans: Sequence[tuple[K, int]], *, align: int = 1,
          device: torch.device | str = "cpu") -> tuple[torch.Tensor, dict[K, torch.Tensor]]:
    """``(arena, {key: uint8 view})``: one view of ``nbytes`` per ``(key, nbytes)``, in order, each
    starting at a multiple of ``align`` bytes. ``arena`` is reused when it is a uint8 tensor on
    ``device`` large enough (a previous receiver's, already touched), else a new one from
    :func:`~fastsync.executor.staging.alloc_touched` (its pages faulted in once, at set-up)."""
    need = arena_bytes([n for _, n in spans], align)
    want = torch.device(device)
    if (arena is None or arena.dtype != torch.uint8 or arena.numel() < need or arena.device.type != want.type
            or want.index not in (None, arena.device.index)):
        arena = alloc_touched(need, device)
    views: dict[K, torch.Tensor] = {}
    off = 0
    for key, n in spans:
        views[key] = arena[off: off + int(n)]
        off += _up(int(n), align)
    return arena, views


def carve_typed(arena: torch.Tensor | None, specs: Sequence[tuple[K, Sequence[int], torch.dtype]], *,
                align: int = CACHE_LINE) -> tuple[torch.Tensor, dict[K, torch.Tensor]]:
    """:func:`carve` for tensors: one view per ``(key, shape, dtype)``, of that shape and dtype
    (``align`` must be a multiple of every dtype's size)."""
    arena, raw = carve(arena, [(key, nbytes_of(shape, dtype)) for key, shape, dtype in specs], align=align)
    return arena, {key: raw[key].view(dtype).view(tuple(shape)) for key, shape, dtype in specs}
