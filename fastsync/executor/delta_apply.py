"""Applying ``sparse`` delta records into live CPU tensors in one pass, keeping the old values.

The receiver's plain path turns a record into int64 positions (``repeat_interleave`` over the
chunk table, then the destination runs), gathers the old values for the rollback copy and
scatters the new ones: five passes and three temporaries per record. For the common case (a
``sparse`` record of a transfer that lands as one contiguous run of its destination tensor)
these numba kernels (optional, as in :mod:`fastsync.executor.delta_scan`) do it directly:

* :func:`check` walks the chunk table and the positions once: chunk ids strictly increasing and
  inside the transfer, positions strictly increasing inside their chunk and inside the transfer,
  counts adding up. Nothing is written before every record of every stream has passed.
* :func:`swap` writes each new value and keeps the value it overwrote in ``old`` (the rollback
  copy covers exactly what the delta overwrote); :func:`restore` puts the old values back.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np

from fastsync.executor.delta_scan import available

__all__ = ["available", "warmup", "check", "swap", "restore"]

_K: Any = None


def _kernels() -> Any:
    """Define the kernels on first use (numba imported lazily, as in ``delta_scan``)."""
    global _K
    if _K is None:
        _K = False
        if available():
            import numba as _nb

            _K = _define(_nb)
    return _K


def _define(_nb: Any) -> Any:  # pragma: no cover - compiled
    """The kernels (``check``, ``swap``, ``restore``), defined once numba is imported."""

    @_nb.njit(nogil=True, cache=True)
    def _check(ids, counts, local, chunk, n):  # pragma: no cover - compiled
        o = 0
        prev_id = -1
        for j in range(ids.shape[0]):
            c = np.int64(ids[j])
            k = np.int64(counts[j])
            if c <= prev_id or c * chunk >= n or k < 0 or o + k > local.shape[0]:
                return False
            prev_id = c
            last = -1
            lim = min(chunk, n - c * chunk)
            for q in range(o, o + k):
                p = np.int64(local[q])
                if p <= last or p >= lim:
                    return False
                last = p
            o += k
        return o == local.shape[0]

    @_nb.njit(nogil=True, cache=True)
    def _swap(flat, off, ids, counts, local, vals, chunk, old):  # pragma: no cover - compiled
        o = 0
        for j in range(ids.shape[0]):
            a = off + np.int64(ids[j]) * chunk
            for q in range(o, o + np.int64(counts[j])):
                p = a + np.int64(local[q])
                old[q] = flat[p]
                flat[p] = vals[q]
            o += np.int64(counts[j])

    @_nb.njit(nogil=True, cache=True)
    def _restore(flat, off, ids, counts, local, old, chunk):  # pragma: no cover - compiled
        o = local.shape[0]
        for j in range(ids.shape[0] - 1, -1, -1):
            a = off + np.int64(ids[j]) * chunk
            o -= np.int64(counts[j])
            for q in range(o + np.int64(counts[j]) - 1, o - 1, -1):
                flat[a + np.int64(local[q])] = old[q]

    return SimpleNamespace(check=_check, swap=_swap, restore=_restore)


def check(ids: np.ndarray, counts: np.ndarray, local: np.ndarray, chunk: int, n: int) -> bool:
    """Whether a sparse record's table and positions are well formed for a transfer of ``n``."""
    return bool(_kernels().check(ids, counts, local, chunk, n))


def swap(flat: np.ndarray, off: int, ids: np.ndarray, counts: np.ndarray, local: np.ndarray,
         vals: np.ndarray, chunk: int, old: np.ndarray) -> None:
    """``flat[off + ids*chunk + local] = vals``, the overwritten values into ``old``."""
    _kernels().swap(flat, off, ids, counts, local, vals, chunk, old)


def restore(flat: np.ndarray, off: int, ids: np.ndarray, counts: np.ndarray, local: np.ndarray,
            old: np.ndarray, chunk: int) -> None:
    """Undo :func:`swap` (in reverse order)."""
    _kernels().restore(flat, off, ids, counts, local, old, chunk)


def warmup(itemsizes: set[int] | None = None) -> None:
    """Compile (or load from numba's cache) the kernels for the element sizes an engine rank holds
    (2 and/or 4 bytes; None: both), off the first sync's path."""
    if not available():
        return
    body = np.zeros(64, dtype=np.uint8)
    ids, counts = body[:4].view(np.int32), body[8:12].view(np.int32)
    local = body[16:18].view(np.uint16)
    for uint in (np.uint16, np.uint32):
        if itemsizes is not None and np.dtype(uint).itemsize not in itemsizes:
            continue
        flat = np.zeros(8, dtype=uint)
        vals = body[24: 24 + np.dtype(uint).itemsize].view(uint)
        old = np.empty_like(vals)
        counts[0] = 1
        if check(ids, counts, local, 4, 8):
            swap(flat, 0, ids, counts, local, vals, 4, old)
            restore(flat, 0, ids, counts, local, old, 4)
