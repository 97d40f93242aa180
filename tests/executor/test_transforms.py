"""Built-in transforms: casts, and FP8 block quantisation checked against an independent
per-block loop, plus slice consistency (what lets the planner cut pieces on block edges)."""

from __future__ import annotations


import pytest
import torch

from fastsync import plugins
from fastsync.errors import ConfigError
from fastsync.executor.transforms import FP8_BLOCK, FP8_MAX, apply_transform, to_torch_dtype



pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def test_builtins_register_through_the_plugin_hook() -> None:
    regs = plugins.transforms()
    assert {"copy", "fp8_block", "fp8_scale"} <= set(regs)
    assert regs["copy"].plugin == "builtin_transforms"
    assert regs["copy"].extra["elementwise"] is True
    assert regs["fp8_block"].extra["block"] == FP8_BLOCK


def test_copy_casts_and_never_aliases() -> None:
    src = torch.randn(4, 6)[:, ::2]  # non-contiguous
    out = apply_transform("copy", src, "bfloat16")
    assert out.dtype == torch.bfloat16 and out.is_contiguous()
    assert torch.equal(out, src.to(torch.bfloat16))
    same = apply_transform("copy", src, torch.float32)
    assert same.data_ptr() != src.data_ptr() and torch.equal(same, src)


def _loop_reference(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Independent per-block loop: scale = max(amax, 1e-4)/448, q = e4m3(w * (1/scale)), vLLM's rule."""
    x = w.float()
    rows, cols = x.shape
    nr, nc = -(-rows // 128), -(-cols // 128)
    q = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    s = torch.empty(nr, nc, dtype=torch.float32)
    for i in range(nr):
        for j in range(nc):
            blk = x[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            amax = blk.abs().max().clamp(min=1e-4)
            q[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = (blk * (1.0 / (amax / FP8_MAX))).to(torch.float8_e4m3fn)
            s[i, j] = amax / FP8_MAX
    return q, s


@pytest.mark.parametrize("shape", [(256, 384), (300, 200), (128, 128), (5, 7)])
def test_fp8_block_matches_per_block_loop(shape: tuple[int, int]) -> None:
    w = (torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 4).to(torch.bfloat16)
    q = apply_transform("fp8_block", w, "float8_e4m3fn")
    s = apply_transform("fp8_scale", w, "float32")
    rq, rs = _loop_reference(w)
    assert q.shape == w.shape and s.shape == rs.shape
    assert torch.equal(_bits(q), _bits(rq))
    assert torch.equal(s, rs)
    # dequantised weight is close to the original: e4m3 keeps 3 mantissa bits
    deq = q.float() * s.repeat_interleave(128, 0)[: shape[0]].repeat_interleave(128, 1)[:, : shape[1]]
    assert torch.allclose(deq, w.float(), rtol=0.07, atol=1e-3)


@pytest.mark.parametrize("shape", [(1000, 129), (300, 200), (7, 5), (384, 1029)])
def test_fp8_block_is_bit_equal_to_vllms_own_block_quantizer(shape: tuple[int, int]) -> None:
    """The sender quantizes by vLLM's own rule (``vllm.utils.deep_gemm.per_block_cast_to_fp8``,
    pure torch: runs on any CPU), weights and scales bit for bit. Multiplying by 448/amax instead
    of by 1/scale (what this module did before) rounds 783 of the (1000, 129) values differently."""
    deep_gemm = pytest.importorskip("vllm.utils.deep_gemm", reason="vLLM not installed")
    w = (torch.randn(shape, generator=torch.Generator().manual_seed(2)) * 0.05).to(torch.bfloat16)
    vq, vs = deep_gemm.per_block_cast_to_fp8(w, [FP8_BLOCK, FP8_BLOCK])
    q = apply_transform("fp8_block", w, "float8_e4m3fn")
    s = apply_transform("fp8_scale", w, "float32")
    assert torch.equal(_bits(q), _bits(vq))
    assert torch.equal(s, vs.float())


def test_fp8_batches_over_leading_dims_and_slices_on_block_edges() -> None:
    w = torch.randn(3, 256, 384, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    q = apply_transform("fp8_block", w, "float8_e4m3fn")
    s = apply_transform("fp8_scale", w, "float32")
    assert s.shape == (3, 2, 3)
    for e in range(3):
        rq, rs = _loop_reference(w[e])
        assert torch.equal(_bits(q[e]), _bits(rq)) and torch.equal(s[e], rs)
    part = w[1:3, 128:256, 128:384]
    assert torch.equal(_bits(apply_transform("fp8_block", part, "float8_e4m3fn")), _bits(q[1:3, 128:256, 128:384].contiguous()))
    assert torch.equal(apply_transform("fp8_scale", part, "float32"), s[1:3, 1:2, 1:3])


def test_zero_block_is_finite_and_deterministic() -> None:
    w = torch.zeros(128, 256, dtype=torch.bfloat16)
    q = apply_transform("fp8_block", w, "float8_e4m3fn")
    s = apply_transform("fp8_scale", w, "float32")
    assert torch.equal(q.float(), torch.zeros(128, 256)) and bool(torch.isfinite(s).all())
    assert torch.equal(_bits(apply_transform("fp8_block", w, "float8_e4m3fn")), _bits(q))


def test_unknown_transform_and_dtype_are_named() -> None:
    with pytest.raises(ConfigError, match="rot13"):
        apply_transform("rot13", torch.zeros(2), "float32")
    with pytest.raises(ConfigError, match="float9"):
        to_torch_dtype("float9")
    with pytest.raises(ConfigError, match="float8_e4m3fn"):
        apply_transform("fp8_block", torch.zeros(2, 2), "bfloat16")
