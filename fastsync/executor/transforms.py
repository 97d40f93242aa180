"""Tensor transforms named in ``Piece.transform``: what a sender does to its source slice before
the bytes land at the destination.

Built-ins (registered by ``fastsync._builtin.transforms`` through the ``fastsync`` entry points,
exactly like a third-party plugin's):

* ``copy``: cast to the destination dtype, contiguous.
* ``fp8_block``: 128x128 block e4m3 quantisation over the last two dims (DeepSeek-V3 / vLLM
  block FP8, as DeepGEMM's ``per_block_cast_to_fp8``): per block ``amax = max|w|`` clamped to
  1e-4, ``scale = amax / 448``, ``weight = (w * (1 / scale)).to(float8_e4m3fn)``, bit for bit
  vLLM's ``vllm.utils.deep_gemm.per_block_cast_to_fp8``. Leading dims are batch dims (experts).
* ``fp8_scale``: the matching per-block inverse scales ``amax / 448`` as float32, shape = the
  source shape with the last two dims divided by 128, rounded up.

Blocks start at the origin of the tensor given to the transform, i.e. at the start corner of the
piece's ``src_box``; the planner only splits a block-transform piece at multiples of 128 from that
corner (or gathers the parameter), so per-slice results equal the whole-piece result bit for bit.
All arithmetic is float32 and elementwise or max-reductions, hence deterministic.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fastsync.errors import ConfigError
from fastsync.layout.types import FP8_BLOCK

__all__ = [
    "FP8_BLOCK",
    "FP8_MAX",
    "TransformFn",
    "to_torch_dtype",
    "copy_transform",
    "fp8_block_transform",
    "fp8_scale_transform",
    "fp8_block_quantize",
    "get_transform",
    "apply_transform",
]

#: Largest finite float8_e4m3fn value.
FP8_MAX = 448.0
_AMAX_FLOOR = 1e-4

TransformFn = Callable[[torch.Tensor, torch.dtype], torch.Tensor]


def to_torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"bfloat16"`` (a layout dtype name) or a torch dtype -> torch dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    got = getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(got, torch.dtype):
        raise ConfigError(f"unknown dtype {dtype!r}")
    return got


def copy_transform(src: torch.Tensor, dst_dtype: torch.dtype) -> torch.Tensor:
    """Cast to ``dst_dtype``; always a fresh contiguous tensor (never aliases the trainer's)."""
    return src.to(dtype=dst_dtype, copy=True).contiguous()


def _blocked(src: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """View ``src`` as (B, nr, 128, nc, 128) float32, zero-padded; returns it and the 2-D shape."""
    x = src.float()
    if x.dim() == 0:
        x = x.reshape(1, 1)
    elif x.dim() == 1:
        x = x.reshape(1, -1)
    rows, cols = x.shape[-2], x.shape[-1]
    lead = tuple(x.shape[:-2])
    x = x.reshape(-1, rows, cols)
    nr, nc = -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)
    pad_r, pad_c = nr * FP8_BLOCK - rows, nc * FP8_BLOCK - cols
    if pad_r or pad_c:
        x = torch.nn.functional.pad(x, (0, pad_c, 0, pad_r))
    return x.reshape(x.shape[0], nr, FP8_BLOCK, nc, FP8_BLOCK), lead + (rows, cols)


def fp8_block_quantize(src: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight e4m3 shaped like ``src``, float32 inverse scales with the last two dims / 128)."""
    xb, shape2 = _blocked(src)
    amax = xb.abs().amax(dim=(2, 4), keepdim=True).clamp(min=_AMAX_FLOOR)
    sf = amax / FP8_MAX
    # vLLM's own rule (vllm.utils.deep_gemm.per_block_cast_to_fp8): multiply by 1 / scale, not by
    # FP8_MAX / amax, which rounds differently for about 0.6% of the values
    q = (xb * (1.0 / sf)).to(torch.float8_e4m3fn)
    b, nr, _, nc, _ = xb.shape
    rows, cols = shape2[-2], shape2[-1]
    q = q.reshape(b, nr * FP8_BLOCK, nc * FP8_BLOCK)[:, :rows, :cols]
    scale = sf.reshape(b, nr, nc)
    lead = shape2[:-2]
    weight = q.reshape(src.shape).contiguous()
    if src.dim() >= 2:
        scale = scale.reshape(lead + (nr, nc))
    else:
        scale = scale.reshape(nc) if src.dim() == 1 else scale.reshape(())
    return weight, scale.contiguous()


def fp8_block_transform(src: torch.Tensor, dst_dtype: torch.dtype) -> torch.Tensor:
    if dst_dtype != torch.float8_e4m3fn:
        raise ConfigError(f"transform 'fp8_block' writes float8_e4m3fn, destination is {dst_dtype}")
    return fp8_block_quantize(src)[0]


def fp8_scale_transform(src: torch.Tensor, dst_dtype: torch.dtype) -> torch.Tensor:
    return fp8_block_quantize(src)[1].to(dst_dtype)


def get_transform(name: str) -> TransformFn:
    """The function registered for transform ``name`` (through the plugin hooks)."""
    from fastsync import plugins

    regs = plugins.transforms()
    reg = regs.get(name)
    if reg is None:
        raise ConfigError(f"unknown transform {name!r}; registered: {sorted(regs)}")
    return reg.obj


def apply_transform(name: str, src_tensor: torch.Tensor, dst_dtype: str | torch.dtype) -> torch.Tensor:
    """Run transform ``name`` on ``src_tensor`` (the source box of a piece or transfer, shaped
    like that box) producing the destination bytes in row-major order, dtype ``dst_dtype``."""
    return get_transform(name)(src_tensor, to_torch_dtype(dst_dtype))
