"""A delta link's shape from the plan alone (see :mod:`fastsync.executor.delta` for the stream
format): which transfers trainer rank ``src`` sends engine rank ``dst`` in stream order, how each is
cut into chunks, their element sizes and FP8 block ids, and the worst-case stream bytes both sides
size the outbox and the inbox by, so they agree without talking.
"""

from __future__ import annotations

import torch

from fastsync.layout.box import box_numel, box_shape
from fastsync.layout.types import FP8_BLOCK
from fastsync.plan.delta_sim import DELTA_CHUNK_ELEMS, HEADER_BYTES
from fastsync.plan.replicate import sender_copies
from fastsync.plan.types import Plan, Transfer

__all__ = ["align8", "chunk_spans", "stream_capacity", "block_ids", "transfer_blocks", "transfer_itemsize",
           "link_transfers", "link_capacity"]


def align8(n: int) -> int:
    return -(-n // 8) * 8


def chunk_spans(t: Transfer, itemsize: int, chunk_elems: int = DELTA_CHUNK_ELEMS) -> list[tuple[int, int]]:
    """``(first element, element count)`` of each delta chunk of transfer ``t``."""
    n = t.nbytes // itemsize
    if t.transform == "fp8_block" or n <= chunk_elems:
        return [(0, n)]
    return [(a, min(chunk_elems, n - a)) for a in range(0, n, chunk_elems)]


def stream_capacity(transfers: list[Transfer], itemsizes: list[int], chunk_elems: int = DELTA_CHUNK_ELEMS) -> int:
    """Bytes of the largest stream these transfers can produce (every chunk dense)."""
    total = HEADER_BYTES
    for t, size in zip(transfers, itemsizes):
        total += HEADER_BYTES  # slack for one ``sparse`` record's table and padding
        for _, n in chunk_spans(t, size, chunk_elems):
            total += HEADER_BYTES + align8(n * size)
    return total


def block_ids(shape: tuple[int, ...]) -> torch.Tensor:
    """Per element of a row-major box of ``shape``, the id of its 128x128 FP8 block (blocks over
    the last two dims, leading dims are batch dims, ids row-major over (batch, block row, block col))."""
    if len(shape) == 0:
        return torch.zeros(1, dtype=torch.int64)
    if len(shape) == 1:
        shape = (1,) + tuple(shape)
    rows, cols = shape[-2], shape[-1]
    lead = 1
    for s in shape[:-2]:
        lead *= s
    nr, nc = -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)
    r = torch.arange(rows) // FP8_BLOCK
    c = torch.arange(cols) // FP8_BLOCK
    b = torch.arange(lead)
    ids = (b.view(-1, 1, 1) * nr + r.view(1, -1, 1)) * nc + c.view(1, 1, -1)
    return ids.reshape(-1)


def transfer_blocks(t: Transfer) -> torch.Tensor | None:
    """Per-element block ids of an ``fp8_block`` transfer's destination box, else None."""
    return block_ids(box_shape(t.dst_box)) if t.transform == "fp8_block" else None


def transfer_itemsize(t: Transfer) -> int:
    """Bytes per destination element of ``t`` (from the plan alone)."""
    return t.nbytes // max(1, box_numel(t.dst_box))


def link_transfers(plan: Plan, src_rank: int, dst_rank: int) -> list[tuple[int, Transfer]]:
    """``(flat index, transfer)`` sent from ``src_rank`` to ``dst_rank``, in plan order (the order
    of a stream's records). With a fan-out plan, the copies trainer ``src_rank`` writes itself
    (``plan/replicate.sender_copies``: flat indices, rank-offset destinations), as the dense
    receive program numbers them."""
    return [(i, t) for i, t in sender_copies(plan, src_rank) if t.dst_rank == dst_rank]


def link_capacity(plan: Plan, src_rank: int, dst_rank: int, chunk_elems: int = DELTA_CHUNK_ELEMS) -> int:
    """Worst-case stream bytes from ``src_rank`` to ``dst_rank``: what both sides size the
    outbox and the inbox by, computed from the plan alone so they agree."""
    ts = [t for _, t in link_transfers(plan, src_rank, dst_rank)]
    return stream_capacity(ts, [transfer_itemsize(t) for t in ts], chunk_elems)
