"""Checksum verification: proves a receiver holds exactly the bytes the trainers meant to send.

Each planned transfer gets a digest of its destination bytes in row-major order of its
destination box (the transfer's byte stream). Senders compute it from what they packed (or from
the source, for direct writes); receivers compute it from what landed, after the writes and
before the flip; mismatches are reported by tensor name, box and sending rank, and the version
rolls back. Three modes (``WeightSync(verify=...)``):

* ``"off"``: no digests.
* ``"full"``: a CRC-32 of every byte of every transfer.
* ``"sample"``: a CRC-32 of a sample of the stream's 4 KiB blocks: block 0 of every transfer
  (so every tensor on every engine rank is touched) and every :data:`SAMPLE_EVERY`-th block of
  the rest from a phase ``(13 * version + salt(transfer)) % SAMPLE_EVERY``: the phase visits
  every residue in any :data:`SAMPLE_EVERY` consecutive versions, so a corruption that stays is
  caught within that many versions at most, and transfers of one version sample different
  residues. Both sides read only the sampled bytes. Delta versions are always digested in full.

Sample mode costs what the sampled bytes cost, not a Python step per transfer: a batch of feeds
of one buffer (a chunk's items, an engine rank's landing arena) is compiled once into numpy index
arrays per phase residue (:class:`_FeedSet`, cached: programs are replayed every version, and
the version only picks the residue), its sampled bytes are gathered with one fancy index (4 KiB
windows, plus a few byte patches where a block is cut in several runs) and each transfer's
CRC-32 is one ``zlib.crc32`` call over its contiguous gathered bytes. On a GPU the gather runs
on the device and only the gathered rows cross to the host.
"""

from __future__ import annotations

import zlib
from typing import Callable, Sequence

import numpy as np
import torch

from fastsync.executor.program import RecvProgram
from fastsync.executor.sampling import (SAMPLE_BLOCK, SAMPLE_EVERY, residue, run_ends, salt, sampled_blocks,
                                       sampled_ranges, sampled_runs)
from fastsync.executor.verify_mode import VERIFY_MODES, VerifyMode, verify_mode

__all__ = ["VERIFY_MODES", "VerifyMode", "verify_mode", "Digests", "sampled_blocks", "sampled_ranges", "sampled_runs",
           "SAMPLE_BLOCK", "SAMPLE_EVERY", "crc_update", "receiver_checksums", "compare_checksums", "storage_bytes", "storage_buffers", "gather_pieces"]


def storage_bytes(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A flat uint8 tensor over all of ``t``'s storage, and ``t``'s byte offset in it: the feeds of
    tensors that share memory (an arena's regions, views of one flat shard buffer) share a buffer."""
    st = t.untyped_storage()
    base = torch.empty(0, dtype=torch.uint8, device=t.device).set_(st, 0, (st.nbytes(),))
    return base, t.data_ptr() - st.data_ptr()


_I64 = np.int64
Feed = tuple[int, int, Sequence[tuple[int, int]]]  # (transfer index, buffer number, (offset, length) runs)


class _Selection:
    """The sampled bytes of a :class:`_FeedSet` for one phase residue, in stream order of each
    feed: ``pieces`` ``(transfer index, buffer, lo, hi)`` (byte ranges of the buffer, adjacent
    ones merged), and the same pieces numbered in each buffer's gathered bytes (:meth:`gathered`)
    for buffers not in host memory."""

    __slots__ = ("pieces", "p_buf", "p_lo", "p_len", "nbytes", "_gathered", "_dev")

    def __init__(self, p_index: np.ndarray, p_buf: np.ndarray, p_lo: np.ndarray, p_len: np.ndarray) -> None:
        self.p_buf, self.p_lo, self.p_len = p_buf, p_lo, p_len
        self.pieces = list(zip(p_index.tolist(), p_buf.tolist(), p_lo.tolist(), (p_lo + p_len).tolist()))
        self.nbytes = 100 * len(self.pieces)  # the tuples and arrays, roughly
        self._gathered: list | None = None
        self._dev: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def gathered(self) -> list[tuple[int, int, int, int]]:
        """``pieces`` with ``lo, hi`` counted in the concatenation of their buffer's pieces."""
        if self._gathered is None:
            at: dict[int, int] = {}
            out = []
            for i, b, lo, hi in self.pieces:
                g = at.get(b, 0)
                at[b] = g + hi - lo
                out.append((i, b, g, g + hi - lo))
            self._gathered = out
        return self._gathered

    def device_runs(self, b: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Buffer ``b``'s pieces as ``(offset, length)`` index tensors on ``device``."""
        key = (str(device), b)
        hit = self._dev.get(key)
        if hit is None:
            mine = self.p_buf == b
            hit = self._dev[key] = (torch.from_numpy(self.p_lo[mine]).to(device), torch.from_numpy(self.p_len[mine]).to(device))
        return hit


def gather_pieces(base_u8: torch.Tensor, lo: torch.Tensor, n: torch.Tensor) -> np.ndarray:
    """The bytes of runs ``(lo, n)`` of flat uint8 ``base_u8``, laid end to end, on the host: one
    index on the buffer's device, so only the sampled bytes cross to the host."""
    total = int(n.sum()) if n.numel() else 0
    if not total:
        return np.zeros(0, dtype=np.uint8)
    first = torch.cumsum(n, 0) - n
    idx = torch.repeat_interleave(lo - first, n, output_size=total) + torch.arange(total, device=n.device)
    return base_u8[idx].cpu().numpy()


class _FeedSet:
    """A fixed batch of feeds (:data:`Feed`, transfer ``index`` reading its runs of buffer
    ``buf`` laid end to end from stream offset ``pos``): compiled once into run arrays, from which
    the sample of each phase residue is compiled with a few numpy operations and kept
    (:data:`_SEL_BUDGET` bounds the memory; a small set compiles all residues at once)."""

    def __init__(self, feeds: Sequence[Feed], pos: list[int]) -> None:
        self.index = [i for i, _, _ in feeds]
        self.totals = [_total(runs) for _, _, runs in feeds]
        self.pos = list(pos)
        counts = np.fromiter((len(r) for _, _, r in feeds), dtype=_I64, count=len(feeds))
        flat = np.asarray([x for _, _, r in feeds for run in r for x in run], dtype=_I64).reshape(-1, 2)
        feed = np.repeat(np.arange(len(feeds), dtype=_I64), counts)
        off, n = flat[:, 0], flat[:, 1]
        within = np.cumsum(n) - n  # stream start of each run: its feed's pos plus the runs before it
        head = np.minimum(np.cumsum(counts) - counts, max(n.size - 1, 0))
        s = np.asarray(pos, dtype=_I64)[feed] + within - np.repeat(within[head], counts) if n.size else within
        keep = n > 0
        self.off, self.len, self.s, self.feed = off[keep], n[keep], s[keep], feed[keep]
        self.buf = np.asarray([b for _, b, _ in feeds], dtype=_I64)[self.feed]
        self.idx = np.asarray(self.index, dtype=_I64)
        self.salt = np.asarray([salt(i) for i in self.index], dtype=_I64)[self.feed]
        # about what all SAMPLE_EVERY residues of this set hold, compiled
        self._small = (n.size + int(n.sum()) // SAMPLE_BLOCK + len(feeds)) * 2 * 100 <= _SEL_BUDGET
        self._sel: dict[int, _Selection] = {}
        self._held = 0

    def selection(self, residue: int) -> _Selection:
        hit = self._sel.get(residue)
        if hit is not None:
            return hit
        if not self._sel and self._small:  # a replayed program meets every residue: compile them together
            self._sel = {r: self._compile(r) for r in range(SAMPLE_EVERY)}
            self._held = sum(x.nbytes for x in self._sel.values())
            return self._sel[residue]
        hit = self._compile(residue)
        if self._held + hit.nbytes > _SEL_BUDGET:
            self._sel.clear()
            self._held = 0
        self._sel[residue] = hit
        self._held += hit.nbytes
        return hit

    def _compile(self, residue: int) -> _Selection:
        B, E = SAMPLE_BLOCK, SAMPLE_EVERY
        s, e = self.s, self.s + self.len
        ph = (residue + self.salt) % E
        kf, kl = s // B, (e - 1) // B
        lo = np.maximum(kf, 1)
        k1 = lo + (ph - lo) % E  # each run's first block in its transfer's phase (block 0 apart)
        cnt = np.where(kl >= k1, (kl - k1) // E + 1, 0)
        run = np.repeat(np.arange(s.size, dtype=_I64), cnt)
        k = np.repeat(k1 - E * (np.cumsum(cnt) - cnt), cnt) + E * np.arange(run.size, dtype=_I64)
        z = np.flatnonzero(kf == 0)  # runs that touch block 0
        run = np.concatenate([z, run])
        k = np.concatenate([np.zeros(z.size, dtype=_I64), k])
        order = np.lexsort((k, run))  # stream order: runs in feed order, blocks in order within a run
        run, k = run[order], k[order]
        start = np.maximum(s[run], k * B)
        plen = np.minimum(e[run], (k + 1) * B) - start
        lo_b = self.off[run] + start - s[run]
        feed, buf = self.feed[run], self.buf[run]
        # merge a piece into the one before when it goes on in the same memory for the same feed
        if run.size:
            joined = np.r_[False, (feed[1:] == feed[:-1]) & (lo_b[1:] == lo_b[:-1] + plen[:-1])]
            group = np.cumsum(~joined) - 1
            heads = np.flatnonzero(~joined)
            plen = np.bincount(group, weights=plen).astype(_I64) if joined.any() else plen
            lo_b, feed, buf = lo_b[heads], feed[heads], buf[heads]
        return _Selection(self.idx[feed], buf, lo_b, plen)


def _total(runs: Sequence[tuple[int, int]]) -> int:
    return sum(n for _, n in runs) if len(runs) <= 64 else run_ends(runs)[-1]


_SEL_BUDGET = 64 << 20  # bytes of compiled samples one feed set keeps
_FEEDSETS: dict[int, tuple[object, dict]] = {}  # id(feeds) -> (feeds, {which feeds are sampled: compiled})
_FEEDSETS_MAX = 1 << 12


def _feedset(feeds: Sequence[Feed], mask: tuple[bool, ...] | None,
             pos_of: Callable[[list[int], list[int]], list[int]]) -> _FeedSet:
    """The compiled :class:`_FeedSet` of ``feeds`` (those ``mask`` marks, default all), cached by
    the list's identity (held, so its id stays its own): programs replay their lists every version.
    ``pos_of(indices, totals)`` gives the feeds' stream offsets (called once); when they changed,
    it recompiles."""
    hit = _FEEDSETS.get(id(feeds))
    if hit is None or hit[0] is not feeds:
        if len(_FEEDSETS) >= _FEEDSETS_MAX:
            _FEEDSETS.clear()
        hit = _FEEDSETS[id(feeds)] = (feeds, {})
    fs = hit[1].get(mask)
    picked = feeds if mask is None else [f for f, m in zip(feeds, mask) if m]
    if fs is not None:
        pos = pos_of(fs.index, fs.totals)
        if pos == fs.pos:
            return fs
    else:
        pos = pos_of([i for i, _, _ in picked], [_total(runs) for _, _, runs in picked])
    fs = hit[1][mask] = _FeedSet(picked, pos)
    return fs


class Digests:
    """Per-transfer digests of one version, fed each transfer's bytes in stream order (pieces
    of any size). ``mode_of(index)``: the mode of that transfer (its engine rank asked for it)."""

    def __init__(self, version: int, mode_of: Callable[[int], str], uniform: str | None = None) -> None:
        """``uniform``: the mode of every transfer, when the caller knows it is one (spares a
        ``mode_of`` call per transfer in :meth:`feed_batch`)."""
        self.version, self.mode_of, self.uniform = version, mode_of, uniform
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
        self._pos[index] = pos + run_ends(runs)[-1]
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

    def feed_batch(self, bases: Sequence[torch.Tensor], feeds: Sequence[Feed]) -> None:
        """:meth:`feed_runs` of every ``(transfer index, buffer, runs)`` of ``feeds`` (``runs`` in
        flat uint8 ``bases[buffer]``; a transfer's feeds in stream order), at the cost of the
        sampled bytes: the sampled feeds are compiled once per list (pass the same list every
        version: :class:`_FeedSet`) and each sampled piece is one ``zlib.crc32`` call on a view
        (a buffer off the host is gathered on its device first: only its sampled bytes cross).
        Full feeds go through :meth:`feed_runs`."""
        if self.uniform is not None:
            modes = None if self.uniform == "sample" else [self.uniform] * len(feeds)
        else:
            modes = [self.mode_of(i) for i, _, _ in feeds]
            if all(m == "sample" for m in modes):
                modes = None
        if modes is not None:
            for (i, b, runs), m in zip(feeds, modes):
                if m == "full":
                    self.feed_runs(i, bases[b], runs)
            mask: tuple[bool, ...] | None = tuple(m == "sample" and bool(runs) for (_, _, runs), m in zip(feeds, modes))
            if not any(mask):
                return
        else:
            mask = None if all(runs for _, _, runs in feeds) else tuple(bool(runs) for _, _, runs in feeds)
        at = self._pos

        def pos_of(index: list[int], totals: list[int]) -> list[int]:
            out = []
            for i, n in zip(index, totals):
                p = at.get(i, 0)
                out.append(p)
                at[i] = p + n
            return out

        fs = _feedset(feeds, mask, pos_of)
        sel = fs.selection(residue(self.version))
        crcs = self.crcs
        for i in fs.index:  # a feed with no sampled byte still has its digest (0: nothing read)
            crcs.setdefault(i, 0)
        if all(t.device.type == "cpu" for t in bases):
            views = [memoryview(t.numpy()) for t in bases]
            pieces = sel.pieces
        else:
            views = [memoryview(gather_pieces(t, *sel.device_runs(b, t.device))) for b, t in enumerate(bases)]
            pieces = sel.gathered()
        crc32 = zlib.crc32
        for i, b, lo, hi in pieces:
            crcs[i] = crc32(views[b][lo:hi], crcs[i])

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
    destination box: the same value :class:`Digests` gives the sender's pieces. A sample reads
    the regions that share memory (an arena's) as one batch (:meth:`Digests.feed_batch`)."""
    if mode == "sample":
        d = Digests(version, lambda _i: mode, uniform=mode)
        bases, feeds, indices = _recv_feeds(program, regions)
        d.feed_batch(bases, feeds)
        return {i: d.crcs.get(i, 0) for i in indices}
    out: dict[int, int] = {}
    for _, items in program.by_origin():
        for it in items:
            d = Digests(version, lambda _i: mode)
            d.feed_runs(it.index, regions[it.transfer.dst_tensor], it.dst_runs)
            out[it.index] = d.crcs.get(it.index, 0)
    return out


_RECV: dict[int, tuple[RecvProgram, tuple, tuple]] = {}  # id(program) -> (program, regions' addresses, feeds)


def _recv_feeds(program: RecvProgram, regions: dict[str, torch.Tensor]) -> tuple[list[torch.Tensor], list[Feed], list[int]]:
    """The program's landing memory as feeds for :meth:`Digests.feed_batch`: one buffer per
    distinct storage its regions lie in (an arena is one), each transfer's destination runs moved
    to their offset in it; and every transfer index it receives. Cached per program while its
    regions stay where they were (their addresses and sizes; the cache holds the storages)."""
    names = sorted({it.transfer.dst_tensor for _, items in program.by_origin() for it in items})
    sig = tuple((n, regions[n].data_ptr(), regions[n].numel()) for n in names)
    hit = _RECV.get(id(program))
    if hit is not None and hit[0] is program and hit[1] == sig:
        return hit[2]
    bases, buffer_of = storage_buffers([regions[n] for n in names])
    where = dict(zip(names, buffer_of))
    feeds: list[Feed] = []
    for _, items in program.by_origin():
        for it in items:
            b, off = where[it.transfer.dst_tensor]
            feeds.append((it.index, b, [(o + off, n) for o, n in it.dst_runs] if off else it.dst_runs))
    out = (bases, feeds, [it.index for _, items in program.by_origin() for it in items])
    if len(_RECV) >= 64:
        _RECV.clear()
    _RECV[id(program)] = (program, sig, out)
    return out


def storage_buffers(tensors: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[tuple[int, int]]]:
    """Distinct storages of flat uint8 ``tensors`` (:func:`storage_bytes`), and per tensor its
    ``(buffer number, byte offset)`` in them."""
    slot: dict[tuple[str, int], int] = {}
    bases: list[torch.Tensor] = []
    out = []
    for t in tensors:
        base, off = storage_bytes(t) if t.numel() else (t, 0)
        key = (str(t.device), base.data_ptr() if t.numel() else -len(bases) - 1)
        if key not in slot:
            slot[key] = len(bases)
            bases.append(base)
        out.append((slot[key], off))
    return bases, out


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
