"""Verification modes (``fastsync.executor.verify``): digests do not depend on how a transfer's
bytes are cut into pieces, a sample reads about 1/32 of a large transfer and always its first
block, and moves with the version; bad mode names are refused naming the option."""

from __future__ import annotations

import pytest
import torch

from fastsync.errors import ConfigError
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
