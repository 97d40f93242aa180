"""Delta encoding: only the elements (or FP8 128x128 blocks) that changed since the last version
a receiver holds, lossless, pure torch.

The unit is a *delta chunk*: a run of at most ``chunk_elems`` elements of one planned transfer, in
the destination's row-major order (the order the transfer's bytes land in). A block-FP8 weight
transfer (``fp8_block``) is one chunk whose elements are grouped into 128x128 blocks of its box,
the blocks the transform quantises together. Per chunk the sender compares the new engine bytes
(after cast / quantisation: what the engine holds) with the last bytes it sent, bit for bit, and
writes the cheapest of, by the measured count ``k`` of changed elements of ``n``:

* ``index``: ``k`` int32 positions, then ``k`` values (``k * (4 + itemsize)`` bytes);
* ``bitmap``: ``ceil(n/8)`` bytes of bits, then ``k`` values;
* ``blocks`` (FP8 weights only): the changed block ids (int32), then every element of those
  blocks, block by block;
* ``dense``: all ``n`` values (where the delta does not pay);
* nothing at all for an unchanged chunk.

A stream (one per sending rank and receiving rank per version) is a 64-byte header (magic,
version, base version, number of chunk records, total bytes) followed by chunk records, each a
64-byte header (transfer index, first element, element count, kind, count, payload bytes) and an
8-byte aligned payload. The base version is the version the sender encoded against: -1 means
every chunk is dense (a receiver that missed a version, restarted, rolled back or is new), so a
receiver never applies a delta against a base it does not hold. The worst-case stream size
(every chunk dense) is :func:`stream_capacity`, what both sides size the inbox/outbox by.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from fastsync.errors import SyncError
from fastsync.executor import delta_scan
from fastsync.executor.delta_links import (align8, block_ids, chunk_spans, link_capacity, link_transfers,
                                           stream_capacity, transfer_blocks, transfer_itemsize)
from fastsync.plan.delta_sim import DELTA_CHUNK_ELEMS, HEADER_BYTES, MAX_SPARSE_CHUNK

__all__ = [
    "DELTA_CHUNK_ELEMS",
    "HEADER_BYTES",
    "KINDS",
    "Record",
    "chunk_spans",
    "stream_capacity",
    "encode_chunk",
    "encode_transfer",
    "encode_scanned",
    "write_stream_header",
    "read_stream",
    "decode_positions",
    "block_ids",
    "encoded_bytes",
    "int_view",
    "transfer_blocks",
    "transfer_itemsize",
    "link_transfers",
    "link_capacity",
]

_MAGIC = 0x46534454  # "FSDT"
KINDS = {"dense": 1, "index": 2, "bitmap": 3, "blocks": 4, "sparse": 5}

_KIND_NAMES = {v: k for k, v in KINDS.items()}
_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _record_end(pos: int, payload: int, buf_bytes: int, index: int) -> int:
    """Where a record with ``payload`` bytes written at ``pos`` ends; refused if past the buffer."""
    end = pos + HEADER_BYTES + payload
    if end > buf_bytes:
        raise SyncError(f"delta stream overflows its {buf_bytes}-byte buffer at transfer {index}")
    return end


def _sparse_layout(m: int, k: int, size: int) -> tuple[int, int, int]:
    """Offsets of a sparse record's parts: chunk ids and counts (``a`` bytes each), ``k`` uint16
    positions (``b`` bytes), then ``k`` values; returns ``(a, b, payload)``."""
    a, b, c = align8(4 * m), align8(2 * k), align8(k * size)
    return a, b, 2 * a + b + c


@dataclass(slots=True)
class Record:
    """One decoded chunk record: element positions inside the transfer and their new bytes."""

    index: int  # plan transfer index
    first: int
    count: int  # elements covered by the chunk
    kind: str
    positions: torch.Tensor  # int64 element positions inside the transfer (sorted)
    values_u8: torch.Tensor  # the new values' bytes, in position order


def encoded_bytes(n: int, k: int, itemsize: int) -> dict[str, int]:
    """Payload bytes of each element encoding for ``k`` changed of ``n`` elements."""
    return {"dense": align8(n * itemsize), "index": align8(4 * k) + align8(k * itemsize),
            "bitmap": align8(-(-n // 8)) + align8(k * itemsize)}


def encode_chunk(out_u8: torch.Tensor, pos: int, index: int, first: int, new: torch.Tensor, old: torch.Tensor,
                 *, force_dense: bool = False, blocks: torch.Tensor | None = None,
                 changed: torch.Tensor | None = None) -> tuple[int, int]:
    """Encode one chunk (``new``/``old``: flat integer views of the same dtype) at byte ``pos`` of
    ``out_u8``. Returns ``(new pos, changed elements)``; an unchanged chunk writes nothing.
    ``blocks``: the chunk's per-element FP8 block ids (block encoding instead of elements);
    ``changed``: the change mask when already computed."""
    n = new.numel()
    size = new.element_size()
    if force_dense:
        changed_mask = None
        k = n
    else:
        changed_mask = new != old if changed is None else changed
        k = int(changed_mask.sum())
        if k == 0:
            return pos, 0
    if changed_mask is None:
        costs = {"dense": align8(n * size)}
    elif blocks is not None:
        changed_blocks = torch.unique(blocks[changed_mask])
        m = int(torch.isin(blocks, changed_blocks).sum())
        costs = {"dense": align8(n * size), "blocks": align8(4 * changed_blocks.numel()) + align8(m * size)}
    else:
        costs = encoded_bytes(n, k, size)
    kind = min(costs, key=lambda name: (costs[name], name != "dense"))
    payload = costs[kind]
    end = _record_end(pos, payload, out_u8.numel(), index)
    body = out_u8[pos + HEADER_BYTES: end]
    if kind == "dense":
        body[: n * size].copy_(new.view(torch.uint8))
        count = n
    elif kind == "index":
        idx = changed_mask.nonzero().view(-1)
        body[: 4 * k].copy_(idx.to(torch.int32).view(torch.uint8))
        off = align8(4 * k)
        body[off: off + k * size].copy_(new[idx].view(torch.uint8))
        count = k
    elif kind == "bitmap":
        nb = -(-n // 8)
        bits = torch.zeros(nb * 8, dtype=torch.uint8)
        bits[:n] = changed_mask.to(torch.uint8)
        weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)
        packed = (bits.view(nb, 8) * weights).sum(dim=1, dtype=torch.int32).to(torch.uint8)
        body[:nb].copy_(packed)
        off = align8(nb)
        body[off: off + k * size].copy_(new[changed_mask].view(torch.uint8))
        count = k
    else:  # blocks
        nbk = changed_blocks.numel()
        body[: 4 * nbk].copy_(changed_blocks.to(torch.int32).view(torch.uint8))
        order = _block_order(blocks)
        sel = order[torch.isin(blocks[order], changed_blocks)]
        off = align8(4 * nbk)
        body[off: off + sel.numel() * size].copy_(new[sel].view(torch.uint8))
        count = nbk
    hdr = torch.tensor([index, first, n, KINDS[kind], count, payload, 0, 0], dtype=torch.int64)
    out_u8[pos: pos + HEADER_BYTES].copy_(hdr.view(torch.uint8))
    return end, k


def encode_transfer(out_u8: torch.Tensor, pos: int, index: int, new: torch.Tensor, old: torch.Tensor,
                    chunk_elems: int) -> tuple[int, int, int]:
    """Encode one plain (element-wise) transfer against its base, vectorised over the transfer.
    Per chunk of ``chunk_elems`` the cheapest of uint16 positions + values (gathered into one
    ``sparse`` record per transfer: chunk ids, per-chunk counts, positions, values), ``bitmap``
    or ``dense`` is chosen from the measured count of changed elements. Updates ``old`` to
    ``new``. Returns ``(new pos, changed elements, records written)``."""
    if chunk_elems > MAX_SPARSE_CHUNK:
        raise SyncError(f"chunk_elems {chunk_elems} > {MAX_SPARSE_CHUNK}: positions would not fit uint16")
    n_all = new.numel()
    size = new.element_size()
    if new.device.type == "cpu":  # numpy's compare and flatnonzero run ~5x faster than torch's here
        a, b = new.numpy(), old.numpy()
        mask_np = np.not_equal(a, b)
        idx_np = np.flatnonzero(mask_np)
        if idx_np.size == 0:
            return pos, 0, 0
        vals_np = a[idx_np]
        b[idx_np] = vals_np  # the base moves to this version (only the changed elements)
        mask, idx, vals = torch.from_numpy(mask_np), torch.from_numpy(idx_np), torch.from_numpy(vals_np)
    else:
        mask = new != old
        idx = mask.nonzero().view(-1)
        if idx.numel() == 0:
            return pos, 0, 0
        vals = new[idx]
        old[idx] = vals
    k_all = idx.numel()
    num_chunks = -(-n_all // chunk_elems)
    cid = idx // chunk_elems
    counts = torch.bincount(cid, minlength=num_chunks)
    lens = torch.full((num_chunks,), chunk_elems, dtype=torch.int64)
    lens[-1] = n_all - (num_chunks - 1) * chunk_elems
    cost_idx = 2 * counts + counts * size + 16
    cost_bits = (lens + 7) // 8 + counts * size
    cost_dense = lens * size
    sparse = (counts > 0) & (cost_idx <= cost_bits) & (cost_idx <= cost_dense)
    records = 0
    if bool(sparse.any()):
        ids = sparse.nonzero().view(-1)
        if ids.numel() == int((counts > 0).sum()):  # every changed chunk is sparse (the usual case)
            local = (idx - cid * chunk_elems).to(torch.int32).to(torch.uint16)
            sv = vals
        else:
            sel = sparse[cid]
            local = (idx[sel] - cid[sel] * chunk_elems).to(torch.int32).to(torch.uint16)
            sv = vals[sel]
        m, k = ids.numel(), local.numel()
        a, b, payload = _sparse_layout(m, k, size)
        end = _record_end(pos, payload, out_u8.numel(), index)
        body = out_u8[pos + HEADER_BYTES: end]
        body[: 4 * m].copy_(ids.to(torch.int32).view(torch.uint8))
        body[a: a + 4 * m].copy_(counts[ids].to(torch.int32).view(torch.uint8))
        body[2 * a: 2 * a + 2 * k].copy_(local.view(torch.uint8))
        body[2 * a + b: 2 * a + b + k * size].copy_(sv.view(torch.uint8))
        hdr = torch.tensor([index, 0, n_all, KINDS["sparse"], m, payload, chunk_elems, k], dtype=torch.int64)
        out_u8[pos: pos + HEADER_BYTES].copy_(hdr.view(torch.uint8))
        pos = end
        records += 1
    rest = ((counts > 0) & ~sparse).nonzero().view(-1).tolist()
    for c_ in rest:  # chunks where many elements changed: bitmap or dense (rare at RL learning rates)
        first = c_ * chunk_elems
        n = int(lens[c_])
        pos, _ = encode_chunk(out_u8, pos, index, first, new[first: first + n], old[first: first + n],
                                changed=mask[first: first + n])
        records += 1
    return pos, k_all, records


def encode_scanned(out_u8: torch.Tensor, pos: int, index: int, r: Any, new: np.ndarray) -> tuple[int, int, int]:
    """Encode one transfer from a fused scan (:func:`fastsync.executor.delta_scan.scan`) with the
    same records and cost rules as :func:`encode_transfer`. ``new``: the transfer's new engine
    bits (the base after the scan moved it), read for the chunks that go dense. Returns ``(new pos, changed elements, records written)``."""
    counts, chunk = r.counts, r.chunk
    n_all = new.shape[0]
    size = new.itemsize
    num_chunks = counts.shape[0]
    k_all = int(counts.sum())
    if k_all == 0:
        return pos, 0, 0
    out_np = out_u8.numpy()  # the outbox is host memory here (the scan runs on CPU sources only)
    shortest = min(chunk, n_all - (num_chunks - 1) * chunk)
    most = int(counts.max())
    cost = 2 * most + most * size + 16
    if cost <= (shortest + 7) // 8 + most * size and cost <= shortest * size:
        # the usual case: even the busiest chunk is cheapest as positions, so every changed one is
        # (the costs below grow slower in the count than the bitmap's and dense's)
        ids = np.flatnonzero(counts)
        sparse = None
    else:
        lens = np.full(num_chunks, chunk, dtype=np.int64)
        lens[-1] = n_all - (num_chunks - 1) * chunk
        cost_idx = 2 * counts + counts * size + 16
        cost_bits = (lens + 7) // 8 + counts * size
        sparse = (counts > 0) & (cost_idx <= cost_bits) & (cost_idx <= lens * size)
        ids = np.flatnonzero(sparse)
    records = 0
    if ids.size:
        m, k = ids.size, int(counts[ids].sum())
        a, b, payload = _sparse_layout(m, k, size)
        end = _record_end(pos, payload, out_u8.numel(), index)
        body = out_np[pos + HEADER_BYTES: end]
        body[: 4 * m].view(np.int32)[:] = ids
        body[a: a + 4 * m].view(np.int32)[:] = counts[ids]
        delta_scan.compact(r, ids, body[2 * a: 2 * a + 2 * k].view(np.uint16),
                           body[2 * a + b: 2 * a + b + k * size].view(new.dtype))
        out_np[pos: pos + HEADER_BYTES].view(np.int64)[:] = (index, 0, n_all, KINDS["sparse"], m, payload, chunk, k)
        pos = end
        records += 1
    rest = [] if sparse is None else np.flatnonzero((counts > 0) & ~sparse).tolist()
    for c_ in rest:  # many changed: bitmap or dense
        first, k = c_ * chunk, int(counts[c_])
        n = min(chunk, n_all - first)
        costs = encoded_bytes(n, k, size)
        kind = "dense" if costs["dense"] <= costs["bitmap"] else "bitmap"
        payload = costs[kind]
        end = _record_end(pos, payload, out_u8.numel(), index)
        body = out_np[pos + HEADER_BYTES: end]
        if kind == "dense":
            body[: n * size].view(new.dtype)[:] = new[first: first + n]
            count = n
        else:
            bits = np.zeros(n, dtype=bool)
            bits[r.pos[first: first + k]] = True
            nb = -(-n // 8)
            body[:nb] = np.packbits(bits, bitorder="little")
            off = align8(nb)
            body[off: off + k * size].view(new.dtype)[:] = r.val[first: first + k]
            count = k
        out_np[pos: pos + HEADER_BYTES].view(np.int64)[:] = (index, first, n, KINDS[kind], count, payload, 0, 0)
        pos = end
        records += 1
    return pos, k_all, records


def _block_order(blocks: torch.Tensor) -> torch.Tensor:
    """Element positions sorted by block id, row-major inside each block (stable)."""
    return torch.sort(blocks, stable=True).indices


def write_stream_header(out_u8: torch.Tensor, version: int, base_version: int, num_records: int, nbytes: int) -> None:
    hdr = torch.tensor([_MAGIC, version, base_version, num_records, nbytes, 0, 0, 0], dtype=torch.int64)
    out_u8[:HEADER_BYTES].copy_(hdr.view(torch.uint8))


def read_stream(buf_u8: torch.Tensor, who: str) -> tuple[int, int, list[tuple]]:
    """Parse a stream: ``(version, base_version, [(transfer index, first, n, kind, count, payload,
    (extra header fields))])``.
    Raises SyncError naming ``who`` on a malformed stream (checked before anything is applied)."""
    if buf_u8.numel() < HEADER_BYTES:
        raise SyncError(f"{who}: delta stream shorter than its header")
    magic, version, base, num, nbytes = buf_u8[:HEADER_BYTES].view(torch.int64)[:5].tolist()
    if magic != _MAGIC or not HEADER_BYTES <= nbytes <= buf_u8.numel():
        raise SyncError(f"{who}: not a delta stream (magic {magic:#x}, {nbytes} bytes in a {buf_u8.numel()}-byte inbox)")
    out = []
    pos = HEADER_BYTES
    for _ in range(num):
        if pos + HEADER_BYTES > nbytes:
            raise SyncError(f"{who}: delta stream truncated at byte {pos}")
        index, first, n, kind, count, payload, x6, x7 = buf_u8[pos: pos + HEADER_BYTES].view(torch.int64).tolist()
        end = pos + HEADER_BYTES + payload
        if kind not in _KIND_NAMES or end > nbytes or count < 0 or n < 0 or payload < 0:
            raise SyncError(f"{who}: bad delta record at byte {pos} (transfer {index}, kind {kind})")
        out.append((index, first, n, _KIND_NAMES[kind], count, buf_u8[pos + HEADER_BYTES: end], (x6, x7)))
        pos = end
    if pos != nbytes:
        raise SyncError(f"{who}: delta stream has {nbytes - pos} trailing bytes")
    return version, base, out


def decode_positions(kind: str, n: int, count: int, payload: torch.Tensor, itemsize: int,
                     blocks: torch.Tensor | None, who: str, extra: tuple[int, int] = (0, 0)
                     ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``(positions or None for dense, value bytes)`` of one record; checks every bound."""
    if kind == "sparse":
        chunk, k = extra
        if not 0 < chunk <= MAX_SPARSE_CHUNK or k < 0:
            raise SyncError(f"{who}: sparse record with chunk size {chunk} and {k} elements")
        a, b = align8(4 * count), align8(2 * k)
        if payload.numel() < 2 * a + b + k * itemsize:
            raise SyncError(f"{who}: sparse record shorter than its {count} chunks and {k} elements")
        ids = payload[: 4 * count].view(torch.int32).to(torch.int64)
        counts = payload[a: a + 4 * count].view(torch.int32).to(torch.int64)
        if count and (int(ids.min()) < 0 or int(ids.max()) * chunk >= n or int(counts.min()) < 0) \
                or int(counts.sum()) != k:
            raise SyncError(f"{who}: sparse record's chunk table does not fit its {n} elements / {k} positions")
        local = payload[2 * a: 2 * a + 2 * k].view(torch.uint16).to(torch.int64)
        idx = torch.repeat_interleave(ids * chunk, counts) + local
        if k and int(idx.max()) >= n:
            raise SyncError(f"{who}: sparse record points outside its {n} elements")
        return idx, payload[2 * a + b: 2 * a + b + k * itemsize]
    if kind == "dense":
        if payload.numel() < n * itemsize:
            raise SyncError(f"{who}: dense record of {n} elements carries {payload.numel()} bytes")
        return None, payload[: n * itemsize]
    if kind == "index":
        idx = payload[: 4 * count].view(torch.int32).to(torch.int64)
        off = align8(4 * count)
        if count and (int(idx.min()) < 0 or int(idx.max()) >= n):
            raise SyncError(f"{who}: index record points outside its {n} elements")
        vals = payload[off: off + count * itemsize]
    elif kind == "bitmap":
        nb = -(-n // 8)
        packed = payload[:nb]
        shifts = torch.arange(8, dtype=torch.uint8)
        bits = ((packed.view(-1, 1) >> shifts) & 1).view(-1)[:n].bool()
        idx = bits.nonzero().view(-1)
        if idx.numel() != count:
            raise SyncError(f"{who}: bitmap record sets {idx.numel()} bits, header says {count}")
        off = align8(nb)
        vals = payload[off: off + count * itemsize]
    elif kind == "blocks":
        if blocks is None:
            raise SyncError(f"{who}: block record for a transfer that is not block-FP8")
        ids = payload[: 4 * count].view(torch.int32).to(torch.int64)
        order = _block_order(blocks)
        idx = order[torch.isin(blocks[order], ids)]
        off = align8(4 * count)
        vals = payload[off: off + idx.numel() * itemsize]
        count = idx.numel()
    else:  # pragma: no cover - read_stream only yields known kinds
        raise SyncError(f"{who}: unknown record kind {kind!r}")
    if vals.numel() != count * itemsize:
        raise SyncError(f"{who}: {kind} record carries {vals.numel()} value bytes, needs {count * itemsize}")
    return idx, vals


def int_view(t_u8: torch.Tensor, itemsize: int) -> torch.Tensor:
    """A flat uint8 tensor viewed as integers of ``itemsize`` bytes (bitwise comparison)."""
    return t_u8.view(_INT[itemsize])


