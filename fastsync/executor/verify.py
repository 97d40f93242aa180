"""Checksum verification: proves a receiver holds exactly the bytes the trainers meant to send.

Each planned transfer gets a digest of its destination bytes in row-major order of its
destination box (the transfer's byte stream). Senders compute it from what they packed (or from
the source, for direct writes); receivers compute it from what landed, after the writes and
before the flip; mismatches are reported by tensor name, box and sending rank, and the version
rolls back. Three modes (``WeightSync(verify=...)``):

* ``"off"``: no digests.
* ``"full"``: a CRC-32 of every byte of every transfer.
* ``"sample"``: a CRC-32 of a seeded sample of the stream's 4 KiB blocks: block 0 of every
  transfer (so every tensor on every engine rank is touched) and every :data:`SAMPLE_EVERY`-th
  block of the rest from a phase drawn afresh for each transfer and version (the seed is the
  version number), so a corruption that stays is caught within a few versions. Both sides read only the
  sampled bytes. Delta versions are always digested in full.
"""

from __future__ import annotations

import zlib
from bisect import bisect_right
from itertools import accumulate
from typing import Callable, Sequence

import torch

from fastsync.executor.program import RecvProgram
from fastsync.executor.verify_mode import VERIFY_MODES, VerifyMode, verify_mode

__all__ = ["VERIFY_MODES", "VerifyMode", "verify_mode", "Digests", "sampled_blocks", "sampled_ranges", "sampled_runs",
           "crc_update", "receiver_checksums", "compare_checksums"]

#: the sample's block size and rate: block 0 and about one block in SAMPLE_EVERY of each transfer
SAMPLE_BLOCK = 4 << 10
SAMPLE_EVERY = 32
_MASK = (1 << 64) - 1


def _phase(version: int, index: int) -> int:
    """Which residue of :data:`SAMPLE_EVERY` transfer ``index``'s sampled blocks take in ``version`` (splitmix64)."""
    z = (version * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return (z ^ (z >> 31)) % SAMPLE_EVERY


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


def _run_ends(runs: Sequence[tuple[int, int]]) -> list[int]:
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
    ends = _run_ends(runs)
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


class Digests:
    """Per-transfer digests of one version, fed each transfer's bytes in stream order (pieces
    of any size). ``mode_of(index)``: the mode of that transfer (its engine rank asked for it)."""

    def __init__(self, version: int, mode_of: Callable[[int], str]) -> None:
        self.version, self.mode_of = version, mode_of
        self.crcs: dict[int, int] = {}
        self._pos: dict[int, int] = {}

    def feed(self, index: int, data_u8: torch.Tensor) -> None:
        mode = self.mode_of(index)
        if mode == "off":
            return
        n = data_u8.numel()
        pos = self._pos.get(index, 0)
        self._pos[index] = pos + n
        crc = self.crcs.get(index, 0)
        if mode == "full":
            crc = crc_update(crc, data_u8)
        else:
            ranges = sampled_ranges(self.version, index, pos, n)
            if ranges and data_u8.device.type != "cpu":  # only the sampled blocks cross to the host
                for lo, hi in ranges:
                    crc = crc_update(crc, data_u8[lo:hi])
            elif ranges:
                arr = data_u8.numpy()  # one view for every block: slicing numpy is cheaper than torch
                for lo, hi in ranges:
                    crc = zlib.crc32(arr[lo:hi], crc)
        self.crcs[index] = crc

    def feed_runs(self, index: int, base_u8: torch.Tensor, runs: Sequence[tuple[int, int]]) -> None:
        """Feed the bytes of ``runs`` (``(offset, length)`` in flat uint8 ``base_u8``, in stream
        order): :meth:`feed` of each run, reading only the sampled bytes in sample mode."""
        mode = self.mode_of(index)
        if mode == "off" or not runs:
            return
        pos = self._pos.get(index, 0)
        self._pos[index] = pos + _run_ends(runs)[-1]
        crc = self.crcs.get(index, 0)
        pick = runs if mode == "full" else sampled_runs(self.version, index, runs, pos)
        if base_u8.device.type != "cpu":  # only what is digested crosses to the host
            for off, n in pick:
                crc = crc_update(crc, base_u8[off: off + n])
        else:
            arr = base_u8.numpy()  # one view for every run: slicing numpy is cheaper than torch
            for off, n in pick:
                if n:
                    crc = zlib.crc32(arr[off: off + n], crc)
        self.crcs[index] = crc

    def bytes_read(self) -> int:
        """How many of the fed bytes a sample digested (every byte, in full mode)."""
        total = 0
        for index, n in self._pos.items():
            if self.mode_of(index) == "full":
                total += n
            elif self.mode_of(index) == "sample":
                total += sum(hi - lo for lo, hi in sampled_ranges(self.version, index, 0, n))
        return total


def crc_update(crc: int, data_u8: torch.Tensor) -> int:
    """Chain the bytes of a flat, contiguous uint8 CPU tensor into ``crc``."""
    if data_u8.numel() == 0:
        return crc
    if data_u8.device.type != "cpu":
        data_u8 = data_u8.cpu()
    return zlib.crc32(data_u8.numpy(), crc)


def receiver_checksums(program: RecvProgram, regions: dict[str, torch.Tensor], mode: str = "full",
                       version: int = 0) -> dict[int, int]:
    """Per planned transfer index, the digest (``mode``, of ``version``) of what landed in its
    destination box: the same value :class:`Digests` gives the sender's pieces."""
    out: dict[int, int] = {}
    for _, items in program.by_origin():
        for it in items:
            d = Digests(version, lambda _i: mode)
            d.feed_runs(it.index, regions[it.transfer.dst_tensor], it.dst_runs)
            out[it.index] = d.crcs.get(it.index, 0)
    return out


def compare_checksums(program: RecvProgram, expected: dict[int, int], got: dict[int, int]) -> list[str]:
    """Human-readable mismatches (empty when every transfer matches)."""
    bad: list[str] = []
    for src, items in program.by_origin():
        for it in items:
            if it.index not in expected:
                bad.append(f"transfer {it.index} ({it.transfer.dst_tensor!r} from trainer rank {src}): no sender checksum")
            elif expected[it.index] != got.get(it.index):
                bad.append(
                    f"transfer {it.index} ({it.transfer.dst_tensor!r} box {it.transfer.dst_box} from trainer rank {src}): "
                    "checksum mismatch"
                )
    return bad
