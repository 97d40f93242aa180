"""A plan compiled for one rank: which bytes go where, in which staging slot, in which order.

Compiled once at setup and replayed every sync. The sender's program splits large transfers so
each fits a staging slot, assigns every staged piece a fixed offset in the staging arena
(double-buffered: chunk ``k`` uses slot ``k % num_slots``), and marks pieces that can be written
straight from the trainer's own shard memory ("direct": a plain copy, same dtype, contiguous
source). Fixed offsets are what let NIXL descriptors be prepared once.

A receiver's program is the list of regions it must see written, per sending rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from fastsync.errors import ConfigError, PlanError
from fastsync.executor.recv_item import RecvItem
from fastsync.layout.box import Box, box_numel, box_shape, contiguous_runs, to_local
from fastsync.layout.types import DTYPE_BYTES, Shard
from fastsync.plan.replicate import receiver_copies, sender_copies
from fastsync.plan.types import Plan, Transfer

__all__ = [
    "TensorInfo",
    "SendItem",
    "Chunk",
    "SendProgram",
    "RecvItem",
    "RecvProgram",
    "compile_send",
    "compile_recv",
    "split_transfer",
    "locate_source",
    "check_padded",
]

ALIGN_BYTES = 64


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """A destination tensor as a receiver holds it (engine name, local shape, dtype name)."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    def to_json(self) -> list:
        return [self.name, list(self.shape), self.dtype]

    @classmethod
    def from_json(cls, row: list) -> "TensorInfo":
        return cls(row[0], tuple(row[1]), row[2])


def byte_runs(box: Box, info: TensorInfo) -> list[tuple[int, int]]:
    """``(byte_offset, num_bytes)`` runs of ``box`` inside the row-major tensor ``info``."""
    size = info.itemsize
    return [(off * size, n * size) for off, n in contiguous_runs(box, info.shape)]


def split_transfer(t: Transfer, max_bytes: int) -> list[Transfer]:
    """Split ``t`` into pieces of at most ``max_bytes`` (when it can be split), in row-major order
    of its destination, so the concatenated pieces are exactly the bytes of ``t``.

    Only plain copies split (a quantised block must stay whole). Splits the first non-unit dim of
    both boxes (their squeezed shapes agree), recursing into a single row when one row is still
    too large.
    """
    if t.nbytes <= max_bytes or t.transform != "copy":
        return [t]
    dims_dst = [d for d, (s, e) in enumerate(t.dst_box) if e - s > 1]
    dims_src = [d for d, (s, e) in enumerate(t.src_box) if e - s > 1]
    if not dims_dst or not dims_src:
        return [t]
    dd, ds = dims_dst[0], dims_src[0]
    extent = t.dst_box[dd][1] - t.dst_box[dd][0]
    assert extent == t.src_box[ds][1] - t.src_box[ds][0], t
    row_bytes = t.nbytes // extent
    rows = max(1, max_bytes // max(row_bytes, 1))
    out: list[Transfer] = []
    for r0 in range(0, extent, rows):
        r1 = min(extent, r0 + rows)
        db = list(t.dst_box)
        sb = list(t.src_box)
        db[dd] = (t.dst_box[dd][0] + r0, t.dst_box[dd][0] + r1)
        sb[ds] = (t.src_box[ds][0] + r0, t.src_box[ds][0] + r1)
        piece = replace(t, dst_box=tuple(db), src_box=tuple(sb), nbytes=row_bytes * (r1 - r0))
        out.extend(split_transfer(piece, max_bytes) if r1 - r0 == 1 and piece.nbytes > max_bytes else [piece])
    return out


def locate_source(t: Transfer, shards: list[Shard]) -> Shard:
    """The shard of this rank that holds all of ``t.src_box``."""
    for sh in shards:
        if all(s0 <= a and b <= s1 for (a, b), (s0, s1) in zip(t.src_box, sh.box)):
            return sh
    raise PlanError(
        f"trainer rank {t.src_rank} holds no shard of {t.src_param!r} containing {t.src_box} "
        f"(shards: {[s.box for s in shards]}): plan and trainer layout disagree"
    )


@dataclass(slots=True)
class SendItem:
    """One contiguous-in-staging piece of one planned transfer."""

    index: int  # position of the transfer in plan.transfers (verification key)
    transfer: Transfer  # narrowed to this piece when the transfer was split
    dst_runs: list[tuple[int, int]]  # byte runs inside the destination tensor
    chunk: int = -1
    stage_offset: int = -1  # byte offset in the staging arena; -1 when direct
    # byte runs of the source, in destination order: inside the staging arena when staged, inside
    # the source parameter's local buffer when direct
    src_runs: list[tuple[int, int]] = field(default_factory=list)

    @property
    def direct(self) -> bool:
        return self.stage_offset < 0

    def segments(self) -> list[tuple[int, int, int]]:
        """``(src_byte_offset, dst_byte_offset, num_bytes)`` pieces, each contiguous on both sides."""
        out: list[tuple[int, int, int]] = []
        si = di = 0
        s_off, s_left = self.src_runs[0] if self.src_runs else (0, 0)
        d_off, d_left = self.dst_runs[0] if self.dst_runs else (0, 0)
        while si < len(self.src_runs) and di < len(self.dst_runs):
            n = min(s_left, d_left)
            if out and out[-1][0] + out[-1][2] == s_off and out[-1][1] + out[-1][2] == d_off:
                out[-1] = (out[-1][0], out[-1][1], out[-1][2] + n)
            else:
                out.append((s_off, d_off, n))
            s_off, s_left, d_off, d_left = s_off + n, s_left - n, d_off + n, d_left - n
            if s_left == 0:
                si += 1
                if si < len(self.src_runs):
                    s_off, s_left = self.src_runs[si]
            if d_left == 0:
                di += 1
                if di < len(self.dst_runs):
                    d_off, d_left = self.dst_runs[di]
        return out


@dataclass(slots=True)
class Chunk:
    """Items posted together. ``slot`` is the staging slot they were packed into (-1: direct)."""

    index: int
    slot: int
    items: list[SendItem] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(it.transfer.nbytes for it in self.items)

    def dst_ranks(self) -> list[int]:
        return sorted({it.transfer.dst_rank for it in self.items})


@dataclass(slots=True)
class SendProgram:
    rank: int
    chunks: list[Chunk]
    slot_bytes: int
    num_slots: int
    dst_info: dict[int, dict[str, TensorInfo]]

    @property
    def staging_bytes(self) -> int:
        return self.slot_bytes * self.num_slots

    @property
    def bytes_total(self) -> int:
        return sum(c.nbytes for c in self.chunks)

    def bytes_per_dst(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for c in self.chunks:
            for it in c.items:
                out[it.transfer.dst_rank] = out.get(it.transfer.dst_rank, 0) + it.transfer.nbytes
        return out


def _dst_info(dst_info: dict[int, dict[str, TensorInfo]], t: Transfer) -> TensorInfo:
    try:
        return dst_info[t.dst_rank][t.dst_tensor]
    except KeyError:
        raise PlanError(
            f"plan writes tensor {t.dst_tensor!r} on engine rank {t.dst_rank}, which that receiver "
            "does not hold"
        ) from None


def check_padded(plan: Plan, rank: int, info: TensorInfo) -> None:
    """Where the plan records that the engine pads ``info`` (its logical and engine shapes), the
    tensor the receiver holds must have the engine shape: the plan's boxes are in the engine's
    coordinates, so byte offsets into any other shape would land in the wrong place."""
    shapes = plan.padded_shapes(rank, info.name)
    if shapes is not None and tuple(info.shape) != shapes[1]:
        raise PlanError(
            f"engine rank {rank} tensor {info.name!r}: the plan was built for the engine's padded shape "
            f"{shapes[1]} (logical {shapes[0]}), the receiver holds {tuple(info.shape)}: re-plan"
        )


def compile_send(
    plan: Plan,
    rank: int,
    dst_info: dict[int, dict[str, TensorInfo]],
    *,
    shards: dict[str, list[Shard]] | None = None,
    src_dtypes: dict[str, str] | None = None,
    staging_bytes: int = 256 << 20,
    num_slots: int = 2,
    direct: bool = True,
    direct_chunk_bytes: int = 256 << 20,
    min_direct_run_bytes: int = 16 << 10,
    max_chunk_bytes: int | None = None,
) -> SendProgram:
    """Compile ``plan`` for trainer ``rank``.

    ``dst_info`` is what the receivers published (their tensors' shapes and dtypes). With
    ``direct`` (and ``shards``/``src_dtypes`` given), plain same-dtype copies from a contiguous
    regions of a local shard skip staging and are written from the shard's own memory, provided
    the source's contiguous runs average at least ``min_direct_run_bytes`` (many tiny runs, as a
    row-parallel slice of a row-sharded tensor gives, are cheaper packed than posted one by one).
    ``max_chunk_bytes`` caps every chunk (write batch): a relay forwards what one batch completes,
    so batches of a whole share make each hop store-and-forward all of it.
    """
    if num_slots < 1:
        raise ConfigError(f"num_slots must be >= 1, got {num_slots}")
    slot_bytes = (staging_bytes // num_slots) // ALIGN_BYTES * ALIGN_BYTES
    if slot_bytes <= 0:
        raise ConfigError(f"staging_bytes={staging_bytes} too small for {num_slots} slots")
    fill_bytes = slot_bytes if max_chunk_bytes is None else max(ALIGN_BYTES, min(slot_bytes, max_chunk_bytes))
    if max_chunk_bytes is not None:
        direct_chunk_bytes = min(direct_chunk_bytes, max_chunk_bytes)
    # with a fanout, every copy this rank writes itself (flat indices; relayed copies are engine ranks')
    mine = sender_copies(plan, rank)
    direct_items: list[SendItem] = []
    staged_items: list[SendItem] = []
    checked: set[tuple[int, str]] = set()
    for index, t in mine:
        info = _dst_info(dst_info, t)
        if (t.dst_rank, t.dst_tensor) not in checked:
            checked.add((t.dst_rank, t.dst_tensor))
            check_padded(plan, t.dst_rank, info)
        if box_numel(t.dst_box) * info.itemsize != t.nbytes:
            raise PlanError(
                f"transfer {index} to rank {t.dst_rank} tensor {t.dst_tensor!r}: plan says {t.nbytes} bytes, "
                f"receiver's {info.dtype} tensor needs {box_numel(t.dst_box) * info.itemsize}"
            )
        runs = _direct_runs(t, info, shards, src_dtypes, min_direct_run_bytes) if direct else None
        if runs is None:
            staged_items.extend(_staged(index, t, info, fill_bytes, slot_bytes))
            continue
        # a direct transfer larger than a batch goes in pieces too: a relay forwards what one batch
        # completes, so a whole embedding in one batch made every hop store-and-forward all of it
        pieces = split_transfer(t, direct_chunk_bytes)  # [t] when it fits
        piece_runs = [runs] if len(pieces) == 1 else [
            _direct_runs(p, info, shards, src_dtypes, min_direct_run_bytes) for p in pieces]
        if any(r is None for r in piece_runs):  # all pieces one way: checksums chain in destination order
            staged_items.extend(_staged(index, t, info, fill_bytes, slot_bytes))
            continue
        direct_items += [SendItem(index, p, byte_runs(p.dst_box, info), src_runs=r) for p, r in zip(pieces, piece_runs)]
    chunks: list[Chunk] = []
    cur: Chunk | None = None
    used = 0
    for it in direct_items:
        if cur is None or used + it.transfer.nbytes > direct_chunk_bytes and cur.items:
            cur = Chunk(len(chunks), -1)
            chunks.append(cur)
            used = 0
        it.chunk = cur.index
        cur.items.append(it)
        used += it.transfer.nbytes
    cur = None
    num_staged = 0
    for it in staged_items:
        size = -(-it.transfer.nbytes // ALIGN_BYTES) * ALIGN_BYTES
        if cur is None or (used + size > fill_bytes and cur.items):
            cur = Chunk(len(chunks), num_staged % num_slots)
            chunks.append(cur)
            num_staged += 1
            used = 0
        it.chunk = cur.index
        it.stage_offset = cur.slot * slot_bytes + used
        it.src_runs = [(it.stage_offset, it.transfer.nbytes)]
        cur.items.append(it)
        used += size
    return SendProgram(rank, chunks, slot_bytes, num_slots, dst_info)


def _staged(index: int, t: Transfer, info: TensorInfo, fill_bytes: int, slot_bytes: int) -> list[SendItem]:
    """``t`` as staged items of at most ``fill_bytes`` each (a piece that cannot split must fit a slot)."""
    out = []
    for piece in split_transfer(t, fill_bytes):
        if piece.nbytes > slot_bytes:
            raise ConfigError(
                f"transfer of {piece.src_param!r} ({piece.transform}, {piece.nbytes} bytes) does not fit a "
                f"staging slot of {slot_bytes} bytes: raise staging_bytes"
            )
        out.append(SendItem(index, piece, byte_runs(piece.dst_box, info)))
    return out


def _direct_runs(
    t: Transfer, info: TensorInfo, shards: dict[str, list[Shard]] | None, src_dtypes: dict[str, str] | None,
    min_run_bytes: int,
) -> list[tuple[int, int]] | None:
    """Byte runs of ``t``'s source in its local buffer when it can be written as is, else None."""
    if shards is None or src_dtypes is None or t.gathered or t.transform != "copy":
        return None
    if src_dtypes.get(t.src_param) != info.dtype or t.src_param not in shards:
        return None
    sh = locate_source(t, shards[t.src_param])
    runs = contiguous_runs(to_local(t.src_box, sh.box), box_shape(sh.box))
    if not runs or t.nbytes / len(runs) < min_run_bytes:
        return None
    size = info.itemsize
    return [((sh.local_offset + off) * size, n * size) for off, n in runs]


@dataclass(slots=True)
class RecvProgram:
    """``by_src``: writes trainer ranks make into this rank. ``relay`` (an
    ``executor.relay.RelayProgram``, plans with relays only): what arrives from, and is forwarded
    to, other engine ranks."""

    rank: int
    by_src: dict[int, list[RecvItem]]
    tensors: dict[str, TensorInfo]
    relay: Any = None

    @property
    def bytes_total(self) -> int:
        own = sum(it.transfer.nbytes for items in self.by_src.values() for it in items)
        return own + (self.relay.relayed_in_bytes if self.relay is not None else 0)

    def by_origin(self) -> list[tuple[int, list[RecvItem]]]:
        """Every item that lands here, by the trainer rank whose bytes it carries (relayed included)."""
        out = sorted(self.by_src.items())
        if self.relay is not None:
            out += sorted(self.relay.incoming.items())
        return out

    def tensors_from(self, src_rank: int) -> list[str]:
        return sorted({it.transfer.dst_tensor for it in self.by_src.get(src_rank, [])})


def compile_recv(plan: Plan, rank: int, tensors: dict[str, TensorInfo]) -> RecvProgram:
    """What receiver ``rank`` must see written before it may flip, grouped by sending rank.
    Raises PlanError naming the tensor when the plan writes outside what the receiver holds."""
    by_src: dict[int, list[RecvItem]] = {}
    for info in tensors.values():
        check_padded(plan, rank, info)
    for index, t in receiver_copies(plan, rank):
        info = tensors.get(t.dst_tensor)
        if info is None:
            raise PlanError(f"plan writes tensor {t.dst_tensor!r} on engine rank {rank}, which it does not hold")
        if len(t.dst_box) != len(info.shape) or any(not 0 <= s <= e <= n for (s, e), n in zip(t.dst_box, info.shape)):
            raise PlanError(
                f"plan writes box {t.dst_box} of tensor {t.dst_tensor!r} on engine rank {rank}, "
                f"whose shape is {info.shape}"
            )
        if box_numel(t.dst_box) * info.itemsize != t.nbytes:
            raise PlanError(
                f"plan sends {t.nbytes} bytes into {t.dst_tensor!r} box {t.dst_box} on engine rank {rank}, "
                f"which holds {info.dtype}"
            )
        by_src.setdefault(t.src_rank, []).append(RecvItem(index, t, byte_runs(t.dst_box, info)))
    relay = None
    if plan.has_relays:
        from fastsync.executor.relay import compile_relay

        def runs_of(t: Transfer) -> list[tuple[int, int]]:
            info = tensors.get(t.dst_tensor)
            if info is None:
                raise PlanError(f"plan relays tensor {t.dst_tensor!r} through engine rank {rank}, which it does not hold")
            return byte_runs(t.dst_box, info)

        relay = compile_relay(plan, rank, byte_runs_of=runs_of)
    return RecvProgram(rank, by_src, dict(tensors), relay)
