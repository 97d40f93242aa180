"""Per-parameter index of trainer shards, and the box arithmetic the planner needs on top of it.

The planner asks, for each engine piece, "which trainer ranks hold which parts of this source
box?". Answering by scanning every shard of every rank is O(ranks) per piece and O(ranks^2) per
tensor; instead each parameter's distinct shard boxes are sorted along the dim they are cut on
and found by bisection (interval arithmetic per dim). Replicas (HSDP, Megatron DP) collapse onto
one box with several holders. Pure Python: no torch.
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from dataclasses import dataclass

from fastsync.errors import LayoutError
from fastsync.layout.box import Box, box_numel, intersect
from fastsync.layout.types import Shard

__all__ = ["ShardIndex", "build_index", "map_sub_box", "scale_space"]


@dataclass(slots=True)
class ShardIndex:
    """Distinct shard boxes of one parameter with the ranks holding each (sorted, replicas
    together), sorted along ``dim``; ``bisect`` is usable when stops are sorted too."""

    name: str
    boxes: list[Box]
    holders: list[tuple[int, ...]]
    dim: int
    starts: list[int]
    stops: list[int]
    bisect: bool
    disjoint: bool
    ranks: tuple[int, ...]
    complete: bool = False  # disjoint boxes covering every element: no holes to look for
    slab: bool = False  # boxes differ only along ``dim`` (FSDP Shard(d), TP): hits are a range

    def count(self, q: Box) -> int:
        """How many distinct shard boxes ``q`` overlaps."""
        if self.slab and q:
            d = self.dim
            return bisect_left(self.starts, q[d][1]) - bisect_right(self.stops, q[d][0])
        return len(self.hits(q))

    def hits(self, q: Box) -> list[int]:
        """Indices of the boxes overlapping ``q``."""
        if not q:
            return list(range(len(self.boxes)))
        d = self.dim
        if self.bisect:
            lo = bisect_right(self.stops, q[d][0])
            hi = bisect_left(self.starts, q[d][1])
            cand = range(lo, hi)
        else:
            cand = range(len(self.boxes))
        boxes = self.boxes
        out = []
        for i in cand:
            b = boxes[i]
            if all(b0 < q1 and q0 < b1 for (b0, b1), (q0, q1) in zip(b, q)):
                out.append(i)
        return out

    def decompose(self, q: Box) -> list[tuple[Box, tuple[int, ...]]]:
        """Disjoint sub-boxes covering ``q``, each with every rank that holds all of it.
        Raises LayoutError when part of ``q`` is held by no rank."""
        if self.slab and q:
            d = self.dim
            lo = bisect_right(self.stops, q[d][0])
            hi = bisect_left(self.starts, q[d][1])
            q0, q1 = q[d]
            head, tail = q[:d], q[d + 1:]
            boxes, starts, stops, holders = self.boxes, self.starts, self.stops, self.holders
            out = [(head + ((max(q0, starts[i]), min(q1, stops[i])),) + tail, holders[i]) for i in range(lo, hi)]
            if self.complete:
                return out
            got = sum(min(q1, stops[i]) - max(q0, starts[i]) for i in range(lo, hi))
            if got != q1 - q0:
                raise LayoutError(
                    f"parameter {self.name!r}: region {q} is only partly held by trainer ranks "
                    f"({got} of {q1 - q0} rows along dim {d})"
                )
            return out
        hit = self.hits(q)
        if self.disjoint:
            parts = [(intersect(q, self.boxes[i]), self.holders[i]) for i in hit]
            got = sum(box_numel(b) for b, _ in parts)
        else:
            parts = self._grid(q, hit)
            got = sum(box_numel(b) for b, _ in parts)
        if got != box_numel(q):
            raise LayoutError(
                f"parameter {self.name!r}: region {q} is only partly held by trainer ranks "
                f"({got} of {box_numel(q)} elements)"
            )
        return parts  # type: ignore[return-value]

    def _grid(self, q: Box, hit: list[int]) -> list[tuple[Box, tuple[int, ...]]]:
        """Overlapping (non-identical) shard boxes: cut ``q`` on every shard edge inside it and
        give each cell the union of holders of the boxes containing it."""
        cuts = []
        for d, (q0, q1) in enumerate(q):
            pts = {q0, q1}
            for i in hit:
                b0, b1 = self.boxes[i][d]
                if q0 < b0 < q1:
                    pts.add(b0)
                if q0 < b1 < q1:
                    pts.add(b1)
            s = sorted(pts)
            cuts.append(list(zip(s[:-1], s[1:])))
        cells: list[Box] = [()]
        for ranges in cuts:
            cells = [c + (r,) for c in cells for r in ranges]
        out = []
        for cell in cells:
            owners: set[int] = set()
            for i in hit:
                b = self.boxes[i]
                if all(b0 <= c0 and c1 <= b1 for (b0, b1), (c0, c1) in zip(b, cell)):
                    owners.update(self.holders[i])
            if owners:
                out.append((cell, tuple(sorted(owners))))
        return out


def build_index(name: str, shape: tuple[int, ...], shards: tuple[Shard, ...]) -> ShardIndex:
    """Index the shards of one parameter (empty shards dropped, replicas merged)."""
    by_box: dict[Box, list[int]] = {}
    for sh in shards:
        got = by_box.get(sh.box)
        if got is None:
            by_box[sh.box] = [sh.rank]
        else:
            got.append(sh.rank)
    ndim = len(shape)
    boxes = [b for b in by_box if not any(s >= e for s, e in b)]  # FSDP2 trailing ranks hold nothing
    dim = 0
    for d in range(ndim):
        if len({b[d] for b in boxes}) > 1:
            dim = d
            break
    if ndim:
        boxes.sort(key=lambda b: (b[dim], b))
    holders = [tuple(by_box[b]) if len(by_box[b]) == 1 else tuple(sorted(set(by_box[b]))) for b in boxes]
    starts = [b[dim][0] for b in boxes] if ndim else [0] * len(boxes)
    stops = [b[dim][1] for b in boxes] if ndim else [0] * len(boxes)
    monotone = all(stops[i] <= stops[i + 1] for i in range(len(stops) - 1))
    numel = math.prod(shape)
    ranks = tuple(sorted({r for h in holders for r in h}))
    bis = monotone and ndim > 0
    others = tuple((0, n) for n in shape[dim + 1:])
    head = tuple((0, n) for n in shape[:dim])
    slab = bis and all(b[:dim] == head and b[dim + 1:] == others for b in boxes)
    if slab:
        # slabs along one dim are disjoint when each starts at or after the previous one's stop
        inner = numel // shape[dim] if shape[dim] else 0
        total = sum(stops) * inner - sum(starts) * inner
        disjoint = all(stops[i] <= starts[i + 1] for i in range(len(boxes) - 1))
    else:
        total = sum(box_numel(b) for b in boxes)
        disjoint = total <= numel and _pairwise_disjoint(boxes, starts, stops, bis)
    slab = slab and disjoint
    complete = disjoint and total == numel
    return ShardIndex(name, boxes, holders, dim, starts, stops, bis, disjoint, ranks, complete, slab)


def _overlap(a: Box, b: Box) -> bool:
    return all(a0 < b1 and b0 < a1 for (a0, a1), (b0, b1) in zip(a, b))


def _pairwise_disjoint(boxes: list[Box], starts: list[int], stops: list[int], swept: bool) -> bool:
    """No two distinct boxes overlap. With boxes sorted along the cut dim a sweep only compares
    boxes whose ranges on that dim meet (O(n) for FSDP/ZeRO layouts)."""
    n = len(boxes)
    for i in range(n):
        j = i + 1
        while j < n and (not swept or starts[j] < stops[i]):
            if _overlap(boxes[i], boxes[j]):
                return False
            j += 1
    return True


def scale_space(sub: Box, piece_src: Box, block: int) -> tuple[Box, tuple[int, ...]]:
    """Map ``sub`` (inside ``piece_src``, weight coordinates) into the piece's block grid:
    offsets relative to the piece corner, the last two dims (or the only one) counted in blocks.
    Returns (sub in block space, extents of the whole piece in block space)."""
    ndim = len(piece_src)
    block_dims = set(range(max(0, ndim - 2), ndim))
    out = []
    ext = []
    for d, ((s0, s1), (p0, p1)) in enumerate(zip(sub, piece_src)):
        a, b, e = s0 - p0, s1 - p0, p1 - p0
        if d in block_dims:
            out.append((a // block, -(-b // block)))
            ext.append(-(-e // block))
        else:
            out.append((a, b))
            ext.append(e)
    return tuple(out), tuple(ext)


def map_sub_box(sub_rel: Box, src_ext: tuple[int, ...], dst_box: Box) -> Box:
    """Map a sub-box, given relative to the source region's corner (whose extents are
    ``src_ext``), onto the destination region ``dst_box``: the k-th non-unit source dim goes to
    the k-th non-unit destination dim (the shapes agree once size-1 dims are dropped)."""
    out = list(dst_box)
    sd = [d for d, e in enumerate(src_ext) if e != 1]
    dd = [d for d, (a, b) in enumerate(dst_box) if b - a != 1]
    for s, d in zip(sd, dd):
        base = dst_box[d][0]
        out[d] = (base + sub_rel[s][0], base + sub_rel[s][1])
    return tuple(out)
