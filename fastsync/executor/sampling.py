"""Which bytes ``verify="sample"`` reads (see :mod:`fastsync.executor.verify`): block 0 of every
transfer's byte stream and every :data:`SAMPLE_EVERY`-th :data:`SAMPLE_BLOCK` of the rest, from a
phase ``(13 * version + salt(transfer)) % SAMPLE_EVERY`` that visits every residue in any
:data:`SAMPLE_EVERY` consecutive versions. Senders and receivers call the same functions, so both
sides pick the same bytes.
"""

from __future__ import annotations

from bisect import bisect_right
from itertools import accumulate
from typing import Sequence

__all__ = ["SAMPLE_BLOCK", "SAMPLE_EVERY", "salt", "residue", "sampled_blocks", "sampled_ranges", "run_ends",
           "sampled_runs"]

#: the sample's block size and rate: block 0 and about one block in SAMPLE_EVERY of each transfer
SAMPLE_BLOCK = 4 << 10
SAMPLE_EVERY = 32
_MASK = (1 << 64) - 1


_STRIDE = 13  # odd: version -> residue is a bijection on any SAMPLE_EVERY consecutive versions


def salt(index: int) -> int:
    """Transfer ``index``'s fixed offset of its phase (splitmix64 of the index)."""
    z = (index * 0x9E3779B97F4A7C15 + 0x94D049BB133111EB) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return (z ^ (z >> 31)) % SAMPLE_EVERY


def residue(version: int) -> int:
    """The version's part of every phase: the one thing a version changes in a compiled sample."""
    return (version * _STRIDE) % SAMPLE_EVERY


def _phase(version: int, index: int) -> int:
    """Which residue of :data:`SAMPLE_EVERY` transfer ``index``'s sampled blocks take in ``version``."""
    return (residue(version) + salt(index)) % SAMPLE_EVERY


def sampled_blocks(version: int, index: int, first: int, last: int) -> list[int]:
    """The sampled blocks of transfer ``index`` in ``version`` among blocks ``first..last``:
    block 0, then every :data:`SAMPLE_EVERY`-th block from a seeded phase."""
    out = [0] if first == 0 else []
    lo = max(first, 1)
    k = lo + (_phase(version, index) - lo) % SAMPLE_EVERY
    out.extend(range(k, last + 1, SAMPLE_EVERY))
    return out


def sampled_ranges(version: int, index: int, pos: int, n: int) -> list[tuple[int, int]]:
    """The sampled byte ranges ``(lo, hi)`` of the ``n``-byte piece at stream offset ``pos`` of
    transfer ``index`` in ``version``, relative to the piece (:func:`sampled_blocks` cut to it)."""
    if not n:
        return []
    return [(max(pos, k * SAMPLE_BLOCK) - pos, min(pos + n, (k + 1) * SAMPLE_BLOCK) - pos)
            for k in sampled_blocks(version, index, pos // SAMPLE_BLOCK, (pos + n - 1) // SAMPLE_BLOCK)]


_ENDS: dict[int, tuple[Sequence[tuple[int, int]], list[int]]] = {}  # id(runs) -> (runs, their stream ends)
_ENDS_MAX = 1 << 16


def run_ends(runs: Sequence[tuple[int, int]]) -> list[int]:
    """Each run's stream end, laid end to end; cached per run list (a program's lists are replayed
    every version; the cache holds the list, so its id stays its own)."""
    hit = _ENDS.get(id(runs))
    if hit is not None and hit[0] is runs:
        return hit[1]
    ends = list(accumulate(n for _, n in runs))
    if len(runs) > 64:  # short lists cost less to sum than to cache
        if len(_ENDS) >= _ENDS_MAX:
            _ENDS.clear()
        _ENDS[id(runs)] = (runs, ends)
    return ends


def sampled_runs(version: int, index: int, runs: Sequence[tuple[int, int]], pos: int = 0) -> list[tuple[int, int]]:
    """The sampled bytes of ``runs`` (``(offset, length)`` byte runs of a buffer, laid end to end
    from stream offset ``pos`` of transfer ``index``) as ``(offset, length)`` runs of that buffer,
    in stream order: :func:`sampled_ranges` without a Python step per run. A box cut in thousands of
    short rows is found by bisection at each sampled block, so the cost follows the sample, not
    the number of runs."""
    if not runs:
        return []
    ends = run_ends(runs)
    total = ends[-1]
    if not total:
        return []
    out: list[tuple[int, int]] = []
    for k in sampled_blocks(version, index, pos // SAMPLE_BLOCK, (pos + total - 1) // SAMPLE_BLOCK):
        lo, hi = max(0, k * SAMPLE_BLOCK - pos), min(total, (k + 1) * SAMPLE_BLOCK - pos)
        r = bisect_right(ends, lo)
        while lo < hi:
            start = ends[r] - runs[r][1]  # stream offset of run r
            take = min(hi, ends[r]) - lo
            if take > 0:
                out.append((runs[r][0] + lo - start, take))
                lo += take
            r += 1
    return out
