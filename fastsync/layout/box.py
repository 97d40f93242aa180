"""Boxes: half-open rectangular regions of a tensor, the unit every layout and plan speaks in.

A ``Box`` is a tuple with one ``(start, stop)`` pair per tensor dim. Trainer shards, engine
tensor pieces and planned transfers are all boxes, so the planner reduces to intersecting boxes.
Pure Python: no torch, so the planner stays fast and property-testable.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

Box = tuple[tuple[int, int], ...]

__all__ = [
    "Box",
    "full_box",
    "box_shape",
    "box_numel",
    "is_empty",
    "intersect",
    "to_local",
    "to_global",
    "squeeze_shape",
    "contiguous_runs",
    "flat_range_to_boxes",
    "chunk_bounds",
    "even_bounds",
    "box_slices",
    "matching_box",
]


def full_box(shape: Sequence[int]) -> Box:
    """The box covering a whole tensor of ``shape``."""
    return tuple((0, int(n)) for n in shape)


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(stop - start for start, stop in box)


def box_numel(box: Box) -> int:
    return math.prod(stop - start for start, stop in box)


def is_empty(box: Box) -> bool:
    return any(stop <= start for start, stop in box)


def intersect(a: Box, b: Box) -> Box | None:
    """The overlap of two boxes of the same rank, or None when they do not overlap."""
    assert len(a) == len(b), (a, b)
    out = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))
    return None if is_empty(out) else out


def to_local(box: Box, origin: Box) -> Box:
    """Express ``box`` (global coords) relative to the start corner of ``origin``."""
    return tuple((s - o0, e - o0) for (s, e), (o0, _) in zip(box, origin))


def to_global(box: Box, origin: Box) -> Box:
    """Inverse of :func:`to_local`."""
    return tuple((s + o0, e + o0) for (s, e), (o0, _) in zip(box, origin))


def squeeze_shape(shape: Sequence[int]) -> tuple[int, ...]:
    """Shape without size-1 dims: two regions are compatible when these agree."""
    return tuple(int(n) for n in shape if n != 1)


def matching_box(dst: Box, src: Box, inner: Box) -> Box:
    """The box of ``src`` holding the same elements as ``inner`` (a sub-box of ``dst``), where
    ``dst`` and ``src`` hold the same elements in the same row-major order (equal shapes once
    size-1 dims are dropped, as a name map's segments and an engine tensor's pieces are)."""
    if len(src) == len(dst) and all(b - a == d - c for (a, b), (c, d) in zip(src, dst)):
        return tuple((s0 + i0 - d0, s0 + i1 - d0) for (s0, _), (d0, _), (i0, i1) in zip(src, dst, inner))
    dst_nz = [d for d, (a, b) in enumerate(dst) if b - a != 1]
    src_nz = [d for d, (a, b) in enumerate(src) if b - a != 1]
    out = list(src)
    for sd, dd in zip(src_nz, dst_nz):
        s0, d0 = src[sd][0], dst[dd][0]
        out[sd] = (s0 + inner[dd][0] - d0, s0 + inner[dd][1] - d0)
    return tuple(out)


def box_slices(box: Box) -> tuple[slice, ...]:
    """Index a tensor with ``t[box_slices(box)]``."""
    return tuple(slice(s, e) for s, e in box)


def contiguous_runs(box: Box, shape: Sequence[int]) -> list[tuple[int, int]]:
    """The ``(element_offset, num_elements)`` runs that ``box`` occupies in a row-major,
    contiguous tensor of ``shape``, in row-major order of the box. Adjacent runs are merged,
    so a box of whole trailing rows is one run."""
    ndim = len(shape)
    if ndim == 0:
        return [(0, 1)]
    if is_empty(box):
        return []
    strides = [1] * ndim
    for d in range(ndim - 2, -1, -1):
        strides[d] = strides[d + 1] * int(shape[d + 1])
    # Find the innermost dims the box spans fully: those merge into one run per outer index.
    inner = ndim - 1
    while inner > 0 and box[inner] == (0, int(shape[inner])):
        inner -= 1
    run_len = (box[inner][1] - box[inner][0]) * strides[inner]
    outer_ranges = [range(s, e) for s, e in box[:inner]]
    runs: list[tuple[int, int]] = []
    base_inner = box[inner][0] * strides[inner]

    def rec(d: int, offset: int) -> None:
        if d == inner:
            start = offset + base_inner
            if runs and runs[-1][0] + runs[-1][1] == start:
                runs[-1] = (runs[-1][0], runs[-1][1] + run_len)
            else:
                runs.append((start, run_len))
            return
        for i in outer_ranges[d]:
            rec(d + 1, offset + i * strides[d])

    rec(0, 0)
    return runs


def flat_range_to_boxes(start: int, stop: int, shape: Sequence[int]) -> list[Box]:
    """Split the flat, row-major element range ``[start, stop)`` of a tensor of ``shape`` into
    boxes, in order (a DeepSpeed ZeRO-3 partition of one parameter becomes a few boxes)."""
    ndim = len(shape)
    total = math.prod(shape)
    if not 0 <= start <= stop <= total:
        raise ValueError(f"flat range [{start}, {stop}) outside a tensor of {total} elements")
    if start == stop:
        return []
    if ndim <= 1:
        return [((start, stop),)] if ndim == 1 else [()]
    inner = math.prod(shape[1:])
    first_row, first_off = divmod(start, inner)
    last_row, last_off = divmod(stop, inner)
    if first_row == last_row:  # within one row of dim 0: recurse into the trailing dims
        return [((first_row, first_row + 1),) + b for b in flat_range_to_boxes(first_off, last_off, shape[1:])]
    out: list[Box] = []
    if first_off:
        out += [((first_row, first_row + 1),) + b for b in flat_range_to_boxes(first_off, inner, shape[1:])]
        first_row += 1
    if last_row > first_row:
        out.append(((first_row, last_row),) + full_box(shape[1:]))
    if last_off:
        out += [((last_row, last_row + 1),) + b for b in flat_range_to_boxes(0, last_off, shape[1:])]
    return out


def chunk_bounds(size: int, num_chunks: int) -> list[tuple[int, int]]:
    """Bounds of ``torch.chunk(size, num_chunks)`` as FSDP2 ``Shard(dim)`` uses them: chunks of
    ``ceil(size / num_chunks)``, trailing ranks possibly empty. Always ``num_chunks`` entries."""
    if num_chunks <= 0:
        raise ValueError(f"num_chunks must be positive, got {num_chunks}")
    step = -(-size // num_chunks) if size else 0
    return [(min(i * step, size), min((i + 1) * step, size)) for i in range(num_chunks)]


def even_bounds(size: int, num_parts: int) -> list[tuple[int, int]]:
    """Exact equal split (Megatron / vLLM tensor parallel). Raises ValueError when uneven."""
    if num_parts <= 0 or size % num_parts:
        raise ValueError(f"size {size} does not split evenly into {num_parts} parts")
    step = size // num_parts
    return [(i * step, (i + 1) * step) for i in range(num_parts)]
