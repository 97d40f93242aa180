"""Verification modes (``fastsync.executor.verify``): digests do not depend on how a transfer's
bytes are cut into pieces, a sample reads about 1/32 of a large transfer and always its first
block, and moves with the version; bad mode names are refused naming the option."""

from __future__ import annotations

import zlib

import pytest
import torch

from fastsync.errors import ConfigError
from fastsync.executor import verify as V
from fastsync.executor.verify import SAMPLE_BLOCK, SAMPLE_EVERY, Digests, sampled_blocks, sampled_runs, verify_mode


def _feed(mode: str, data: torch.Tensor, cuts: list[int], version: int = 7) -> Digests:
    d = Digests(version, lambda _i: mode)
    prev = 0
    for c in [*cuts, data.numel()]:
        d.feed(3, data[prev:c])
        prev = c
    return d


@pytest.mark.parametrize("mode", ["full", "sample"])
def test_runs_of_a_strided_box_digest_as_their_bytes_laid_end_to_end(mode):
    """``feed_runs`` (one call for thousands of short runs, split over two items of one transfer)
    gives the digest of the runs' bytes laid end to end, as the other side computes it."""
    g = torch.Generator().manual_seed(1)
    base = torch.randint(0, 256, (300_000,), dtype=torch.uint8, generator=g)
    runs = [(i * 1000 + (i % 7), 333 + (i % 5)) for i in range(290)]  # rows of a column slice, uneven
    stream = torch.cat([base[o: o + n] for o, n in runs])
    want = _feed(mode, stream, []).crcs[3]
    d = Digests(7, lambda _i: mode)
    d.feed_runs(3, base, runs[:100])
    d.feed_runs(3, base, runs[100:])
    assert d.crcs[3] == want
    if mode == "sample":  # the sample's runs are exactly the sampled ranges of the stream
        got = b"".join(base[o: o + n].numpy().tobytes() for o, n in sampled_runs(7, 3, runs))
        want_bytes = b""
        for k in sampled_blocks(7, 3, 0, (stream.numel() - 1) // SAMPLE_BLOCK):
            want_bytes += stream[k * SAMPLE_BLOCK: (k + 1) * SAMPLE_BLOCK].numpy().tobytes()
        assert got == want_bytes


@pytest.mark.parametrize("mode", ["full", "sample"])
def test_a_digest_is_the_same_however_the_bytes_arrive(mode):
    data = torch.randint(0, 256, (SAMPLE_BLOCK * 70 + 123,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    whole = _feed(mode, data, []).crcs[3]
    assert _feed(mode, data, [1, SAMPLE_BLOCK - 1, SAMPLE_BLOCK * 33 + 5, SAMPLE_BLOCK * 69]).crcs[3] == whole
    flipped = data.clone()
    flipped[5] ^= 0xFF  # in block 0: every sample covers it
    assert _feed(mode, flipped, [SAMPLE_BLOCK * 3]).crcs[3] != whole


def test_a_sample_reads_a_thirty_second_and_moves_with_the_version():
    n_blocks = 32 * 40
    d = Digests(11, lambda _i: "sample")
    d.feed(0, torch.zeros(n_blocks * SAMPLE_BLOCK, dtype=torch.uint8))
    assert d.bytes_read() == (1 + 40) * SAMPLE_BLOCK or d.bytes_read() == 40 * SAMPLE_BLOCK  # block 0 may be a phase block
    seen = {tuple(sampled_blocks(v, 0, 0, n_blocks - 1)[1:3]) for v in range(20)}
    assert len(seen) > 5  # the phase changes with the version
    assert all(b[1] - b[0] == SAMPLE_EVERY for b in seen)
    off = Digests(1, lambda _i: "off")
    off.feed(0, torch.zeros(10, dtype=torch.uint8))
    assert off.crcs == {} and off.bytes_read() == 0


@pytest.mark.parametrize("value, mode", [(True, "full"), (False, "off"), (None, "off"), ("sample", "sample")])
def test_modes(value, mode):
    got = verify_mode(value)
    assert got == mode and bool(got) is (mode != "off")


@pytest.mark.parametrize("value", ["Full", "yes", 1])
def test_unknown_modes_are_refused_by_name(value):
    with pytest.raises(ConfigError, match=r"WeightSync\(verify=...\) must be one of \['off', 'sample', 'full'\]"):
        verify_mode(value, "WeightSync(verify=...)")


# ---- batched sample digests (Digests.feed_batch, what packers and receivers call every version)

def _stream_digest(mode: str, stream: torch.Tensor, index: int, version: int) -> int:
    d = Digests(version, lambda _i: mode)
    d.feed(index, stream)
    return d.crcs[index]


def _random_layout(seed: int, transfers: int = 12):
    """Transfers of uneven sizes (under a block, a few blocks, tens of blocks), each cut into
    runs scattered over two buffers: the runs of one buffer are placed at random, non-overlapping."""
    g = torch.Generator().manual_seed(seed)
    bufs = [torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, generator=g),
            torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, generator=g)]
    free = [0, 0]
    out = []  # (index, buffer, runs, stream)
    for j in range(transfers):
        size = [300, 5000, SAMPLE_BLOCK * 40 + 77, SAMPLE_BLOCK * 3][j % 4] + int(torch.randint(0, 999, (1,), generator=g))
        b = j % 2
        runs, left = [], size
        while left:
            n = min(left, int(torch.randint(1, 3 * SAMPLE_BLOCK, (1,), generator=g)))
            free[b] += int(torch.randint(0, 64, (1,), generator=g))
            runs.append((free[b], n))
            free[b] += n
            left -= n
        stream = torch.cat([bufs[b][o: o + n] for o, n in runs])
        out.append((10 + 3 * j, b, runs, stream))
    return bufs, out


@pytest.mark.parametrize("mode", ["sample", "full"])
@pytest.mark.parametrize("version", [1, 2, 9, 40])
def test_a_batch_digests_as_the_stream_however_it_is_cut(mode, version):
    """Sender and receiver cut a transfer differently (items, runs, buffers, split transfers):
    the batched digest equals the digest of the stream fed whole, and the one-item feed_runs."""
    bufs, layout = _random_layout(version)
    want = {i: _stream_digest(mode, stream, i, version) for i, _, _, stream in layout}
    feeds = [(i, b, runs) for i, b, runs, _ in layout]
    for _ in range(2):  # compiled once, replayed
        d = Digests(version, lambda _i: mode, uniform=mode)
        d.feed_batch(bufs, feeds)
        assert d.crcs == want
    # one transfer split into two items fed in two batches (a transfer split across chunks)
    i, b, runs, stream = layout[2]
    first, rest = [(i, b, runs[:2])], [(i, b, runs[2:])]
    for _ in range(2):
        d = Digests(version, lambda _i: mode)
        d.feed_batch(bufs, first)
        d.feed_batch(bufs, rest)
        assert d.crcs[i] == want[i]
    ref = Digests(version, lambda _i: mode)
    for i, b, runs, _ in layout:
        ref.feed_runs(i, bufs[b], runs)
    assert ref.crcs == want


def test_a_batch_with_mixed_modes_digests_each_transfer_in_its_own():
    bufs, layout = _random_layout(5)
    modes = {i: ["sample", "full", "off"][k % 3] for k, (i, _, _, _) in enumerate(layout)}
    d = Digests(6, lambda i: modes[i])
    d.feed_batch(bufs, [(i, b, runs) for i, b, runs, _ in layout])
    assert d.crcs == {i: _stream_digest(modes[i], s, i, 6) for i, _, _, s in layout if modes[i] != "off"}


def test_the_device_gather_gives_the_host_bytes():
    """The path a CUDA buffer takes (gather the sampled bytes on its device, then CRC on the host),
    run here on CPU tensors: same digests as the host path."""
    bufs, layout = _random_layout(3)
    feeds = [(i, b, runs) for i, b, runs, _ in layout]
    want = Digests(4, lambda _i: "sample", uniform="sample")
    want.feed_batch(bufs, feeds)
    fs = V._feedset(feeds, None, lambda idx, totals: [0] * len(idx))
    sel = fs.selection(V.residue(4))
    got: dict[int, int] = {}
    views = [memoryview(V.gather_pieces(t, *sel.device_runs(b, t.device))) for b, t in enumerate(bufs)]
    for i, b, lo, hi in sel.gathered():
        got[i] = zlib.crc32(views[b][lo:hi], got.get(i, 0))
    assert got == want.crcs


@pytest.mark.parametrize("where", ["block 0", "sampled block", "unsampled block"])
def test_a_flipped_byte_is_caught_where_the_sample_reads(where):
    bufs, layout = _random_layout(8)
    version = 12
    i, b, runs, stream = layout[2]  # 40+ blocks
    blocks = sampled_blocks(version, i, 0, (stream.numel() - 1) // SAMPLE_BLOCK)
    k = {"block 0": 0, "sampled block": blocks[-1],
         "unsampled block": next(k for k in range(1, 40) if k not in blocks)}[where]
    pos = k * SAMPLE_BLOCK + 123  # stream position -> buffer offset
    at = 0
    for o, n in runs:
        if at <= pos < at + n:
            off = o + pos - at
            break
        at += n
    feeds = [(j, bb, rr) for j, bb, rr, _ in layout]
    d = Digests(version, lambda _i: "sample", uniform="sample")
    d.feed_batch(bufs, feeds)
    bad = [t.clone() for t in bufs]
    bad[b][off] ^= 0x5A
    e = Digests(version, lambda _i: "sample", uniform="sample")
    e.feed_batch(bad, feeds)
    assert {j for j in d.crcs if d.crcs[j] != e.crcs[j]} == (set() if where == "unsampled block" else {i})


def test_every_block_is_sampled_within_sample_every_consecutive_versions():
    n_blocks = 5 * SAMPLE_EVERY + 3
    for index in (0, 7, 225):
        for start in (1, 30):
            seen = set()
            for v in range(start, start + SAMPLE_EVERY):
                got = sampled_blocks(v, index, 0, n_blocks - 1)
                assert got[0] == 0
                seen.update(got)
            assert seen == set(range(n_blocks))
    # transfers of one version do not all sample the same residue
    assert len({sampled_blocks(5, i, 1, SAMPLE_EVERY)[0] for i in range(64)}) > 8


def test_a_corruption_that_stays_is_caught_by_a_batch_within_sample_every_versions():
    bufs, layout = _random_layout(9)
    i, b, runs, _ = layout[2]
    off = runs[-1][0] + runs[-1][1] - 1  # the transfer's last byte: never block 0
    bad = [t.clone() for t in bufs]
    bad[b][off] ^= 1
    feeds = [(j, bb, rr) for j, bb, rr, _ in layout]
    caught = []
    for v in range(100, 100 + SAMPLE_EVERY):
        good, wrong = Digests(v, lambda _i: "sample", uniform="sample"), Digests(v, lambda _i: "sample", uniform="sample")
        good.feed_batch(bufs, feeds)
        wrong.feed_batch(bad, feeds)
        assert all(good.crcs[j] == wrong.crcs[j] for j in good.crcs if j != i)
        caught.append(good.crcs[i] != wrong.crcs[i])
    assert sum(caught) == 1  # the last block is one residue: sampled once in SAMPLE_EVERY versions
