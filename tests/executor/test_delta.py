"""Delta encoding round trips (pure torch): every encoding kind, chosen by measured density, is
lossless; unchanged chunks cost nothing; FP8 block deltas equal re-quantising the full tensor."""

from __future__ import annotations

import pytest
import torch

from fastsync.errors import SyncError
from fastsync.executor.delta import (
    HEADER_BYTES,
    block_ids,
    decode_positions,
    encode_chunk,
    encode_transfer,
    int_view,
    read_stream,
    stream_capacity,
    write_stream_header,
)
from fastsync.executor.transforms import fp8_block_quantize
from fastsync.plan.types import Transfer


def _roundtrip(new: torch.Tensor, old: torch.Tensor, blocks: torch.Tensor | None = None, force_dense: bool = False):
    n, size = new.numel(), new.element_size()
    buf = torch.zeros(2 * HEADER_BYTES + n * size + 64, dtype=torch.uint8)
    pos, k = encode_chunk(buf, HEADER_BYTES, 7, 0, int_view(new.view(torch.uint8), size),
                          int_view(old.view(torch.uint8), size), force_dense=force_dense, blocks=blocks)
    write_stream_header(buf, 3, -1 if force_dense else 2, int(pos > HEADER_BYTES), pos)
    v, base, recs = read_stream(buf, "test")
    assert v == 3
    got = old.clone()
    flat = int_view(got.view(torch.uint8), size)
    kinds = []
    for index, first, cnt, kind, count, payload, extra in recs:
        assert index == 7 and first == 0 and cnt == n
        idx, vals = decode_positions(kind, n, count, payload, size, blocks, "test", extra)
        pos_ = torch.arange(n) if idx is None else idx
        flat[pos_] = int_view(vals.clone(), size)
        kinds.append(kind)
    return got, kinds, pos - HEADER_BYTES, k


@pytest.mark.parametrize("fraction,kind", [(0.0, None), (0.002, "index"), (0.2, "bitmap"), (0.99, "dense")])
def test_bf16_chunk_roundtrip_picks_cheapest_encoding(fraction: float, kind: str | None) -> None:
    g = torch.Generator().manual_seed(1)
    old = torch.randn(10_007, generator=g).to(torch.bfloat16)
    new = old.clone()
    mask = torch.rand(10_007, generator=g) < fraction
    new[mask] = (old[mask].float() + 1.0).to(torch.bfloat16)
    got, kinds, nbytes, k = _roundtrip(new, old)
    assert torch.equal(got.view(torch.int16), new.view(torch.int16))
    assert k == int(mask.sum())
    assert kinds == ([] if kind is None else [kind])
    if kind is None:
        assert nbytes == 0


def test_forced_dense_and_nan_bits_are_exact() -> None:
    old = torch.tensor([float("nan"), 0.0, -0.0, 1.5] * 33 + [2.0], dtype=torch.float32)
    new = old.clone()
    new[2] = 0.0  # -0.0 -> +0.0: equal as floats, different bits
    got, kinds, _, k = _roundtrip(new, old)
    assert k == 1 and torch.equal(got.view(torch.int32), new.view(torch.int32))
    got, kinds, _, _ = _roundtrip(new, old, force_dense=True)
    assert kinds == ["dense"] and torch.equal(got.view(torch.int32), new.view(torch.int32))


def test_fp8_block_delta_equals_requantising_the_full_tensor() -> None:
    g = torch.Generator().manual_seed(2)
    master = torch.randn(3, 300, 257, generator=g)  # experts x rows x cols, edge blocks partial
    w_old, s_old = fp8_block_quantize(master)
    upd = master.clone()
    upd[1, 130:140, 5:9] += 0.5  # touches one block of expert 1
    upd[2, 299, 256] -= 3.0  # the last (partial) block
    w_new, s_new = fp8_block_quantize(upd)
    blocks = block_ids(tuple(w_new.shape))
    got, kinds, nbytes, _ = _roundtrip(w_new.view(torch.uint8).reshape(-1), w_old.view(torch.uint8).reshape(-1),
                                       blocks=blocks)
    assert kinds == ["blocks"]
    assert torch.equal(got, w_new.view(torch.uint8).reshape(-1))  # = re-quantising the whole tensor
    assert nbytes < 3 * 128 * 128 + 64  # two blocks (one partial) and their ids, not the tensor
    got_s, _, _, _ = _roundtrip(s_new.reshape(-1), s_old.reshape(-1))
    assert torch.equal(got_s.view(torch.int32), s_new.reshape(-1).view(torch.int32))


def test_malformed_streams_are_refused_before_apply() -> None:
    buf = torch.zeros(256, dtype=torch.uint8)
    with pytest.raises(SyncError, match="not a delta stream"):
        read_stream(buf, "engine rank 0")
    write_stream_header(buf, 1, 0, 1, 200)
    with pytest.raises(SyncError, match="bad delta record|truncated"):
        read_stream(buf, "engine rank 0")
    # a record claiming a negative payload (would step the parser backwards) is refused
    write_stream_header(buf, 1, 0, 1, 200)
    buf[64:128].view(torch.int64)[:] = torch.tensor([0, 0, 4, 1, 4, -64, 0, 0])
    with pytest.raises(SyncError, match="bad delta record"):
        read_stream(buf, "engine rank 0")
    with pytest.raises(SyncError, match="outside"):
        payload = torch.tensor([5, 0], dtype=torch.int32).view(torch.uint8)
        decode_positions("index", 4, 1, torch.cat([payload, torch.zeros(8, dtype=torch.uint8)]), 2, None, "x")


def test_capacity_covers_every_chunk_dense() -> None:
    t = Transfer(0, 0, "w", ((0, 5), (0, 70001)), "p", ((0, 5), (0, 70001)), "copy", 5 * 70001 * 2)
    cap = stream_capacity([t], [2], chunk_elems=1 << 16)
    chunks = -(-5 * 70001 // (1 << 16))
    assert cap == 2 * HEADER_BYTES + chunks * HEADER_BYTES + sum(
        -(-min(1 << 16, 5 * 70001 - a) * 2 // 8) * 8 for a in range(0, 5 * 70001, 1 << 16))


def test_transfer_encoding_mixes_sparse_bitmap_and_dense_chunks_losslessly() -> None:
    """One transfer of 5 chunks of 4099 elements (the last partial): a sparse chunk, an
    unchanged one, a half-changed one (bitmap), an all-changed one (dense), a sparse last one."""
    g = torch.Generator().manual_seed(3)
    n, chunk = 4 * 4099 + 1234, 4099
    old = torch.randn(n, generator=g).to(torch.bfloat16)
    new = old.clone()
    rate = torch.tensor([0.01] * chunk + [0.0] * chunk + [0.5] * chunk + [1.0] * chunk + [0.02] * 1234)
    mask = torch.rand(n, generator=g) < rate
    new[mask] = (old[mask].float() * 1.5 + 0.25).to(torch.bfloat16)
    base = old.clone()
    buf = torch.zeros(HEADER_BYTES + 5 * HEADER_BYTES + 2 * n + 64, dtype=torch.uint8)
    pos, k, records = encode_transfer(buf, HEADER_BYTES, 4, old.view(torch.int16), base.view(torch.int16), chunk)
    assert (k, records) == (0, 0)  # identical: nothing written
    pos, k, records = encode_transfer(buf, HEADER_BYTES, 4, new.view(torch.int16), base.view(torch.int16), chunk)
    assert k == int((new.view(torch.int16) != old.view(torch.int16)).sum())
    assert torch.equal(base.view(torch.int16), new.view(torch.int16))  # the base moved to the new version
    write_stream_header(buf, 2, 1, records, pos)
    _, _, recs = read_stream(buf, "test")
    assert sorted(r[3] for r in recs) == ["bitmap", "dense", "sparse"]
    got = old.clone().view(torch.int16)
    for index, first, cnt, kind, count, payload, extra in recs:
        idx, vals = decode_positions(kind, cnt, count, payload, 2, None, "test", extra)
        pos_ = torch.arange(cnt) if idx is None else idx
        got[pos_ + first] = int_view(vals.clone(), 2)
    assert torch.equal(got, new.view(torch.int16))
