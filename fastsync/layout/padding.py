"""Engines pad shapes: an engine tensor whose live shape exceeds the name map's (logical) shape.

vLLM allocates some tensors larger than the model needs and never reads the extra elements as
weights:

* the vocabulary (``VocabParallelEmbedding`` / ``ParallelLMHead``) is padded to a multiple of 64
  and every tensor-parallel rank holds ``padded / tp`` rows; the logical rows are a prefix;
* its CPU fused-MoE kernels (``fused_moe/experts/cpu_moe.py``, ``_pad_moe_intermediate``) round
  the per-partition intermediate size ``I`` up to ``P`` (a multiple of 32) and zero-pad each
  part on its own: ``w13_weight`` [E, 2I, H] becomes [E, 2P, H] with gate at rows ``[0, I)`` and
  up at ``[P, P + I)``; ``w2_weight`` [E, H, I] becomes [E, H, P].

One padded dim is a :class:`DimPad`: the dim's logical extent is ``parts`` equal parts of
``logical`` elements; part ``k`` sits at engine index ``k * engine`` and is followed by
``engine - logical`` elements of padding. :func:`pad_tensor` turns a name map's
:class:`EngineTensor` into the engine's: ``shape`` becomes the engine's, ``logical_shape``
keeps the name map's, and every piece's ``dst_box`` moves into the engine's coordinates (split
where a piece crosses a part boundary, the trainer box split with it). From there the planner,
the programs' byte runs, relays, verification and peer reload work on the live memory
unchanged: fastsync writes the logical sub-box and never a padding element, which stays as the
engine made it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fastsync.errors import LayoutError
from fastsync.layout.box import Box, matching_box
from fastsync.layout.types import EngineTensor, Piece

__all__ = ["DimPad", "pad_tensor", "logical_to_engine", "round_up"]


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True, slots=True)
class DimPad:
    """Dim ``dim`` holds ``parts`` parts of ``logical`` elements, each padded to ``engine``."""

    dim: int
    parts: int
    logical: int
    engine: int

    def __post_init__(self) -> None:
        if self.dim < 0 or self.parts < 1 or self.logical < 0 or self.engine < self.logical:
            raise LayoutError(f"padding {self}: needs dim >= 0, parts >= 1 and 0 <= logical <= engine")

    def segments(self) -> list[tuple[int, int, int]]:
        """``(logical_start, logical_stop, engine_start)`` of each part."""
        return [(k * self.logical, (k + 1) * self.logical, k * self.engine) for k in range(self.parts)]


def _remap(box: Box, pads: Sequence[DimPad]) -> list[tuple[Box, Box]]:
    """``box`` (logical coordinates) cut at part boundaries: (logical sub-box, engine box) pairs."""
    out: list[tuple[Box, Box]] = [(box, box)]
    for pad in pads:
        nxt: list[tuple[Box, Box]] = []
        for lbox, ebox in out:
            a, b = lbox[pad.dim]
            for s0, s1, e0 in pad.segments():
                lo, hi = max(a, s0), min(b, s1)
                if lo >= hi:
                    continue
                lsub = lbox[:pad.dim] + ((lo, hi),) + lbox[pad.dim + 1:]
                esub = ebox[:pad.dim] + ((e0 + lo - s0, e0 + hi - s0),) + ebox[pad.dim + 1:]
                nxt.append((lsub, esub))
        out = nxt
    return out


def _check(name: str, shape: tuple[int, ...], pads: Sequence[DimPad]) -> None:
    dims = [p.dim for p in pads]
    if len(set(dims)) != len(dims):
        raise LayoutError(f"engine tensor {name!r}: dim padded twice in {list(pads)}")
    for p in pads:
        if p.dim >= len(shape) or shape[p.dim] != p.parts * p.logical:
            raise LayoutError(
                f"engine tensor {name!r} of shape {shape}: padding {p} expects dim {p.dim} to hold "
                f"{p.parts} x {p.logical} elements"
            )


def pad_tensor(t: EngineTensor, pads: Sequence[DimPad]) -> EngineTensor:
    """``t`` as the engine holds it when it pads ``pads`` (``t`` itself when none pads anything).
    LayoutError naming the tensor for a padding that does not fit its shape, a tensor padded
    twice, or a quantised piece that would have to be split (block scales do not split)."""
    pads = [p for p in pads if p.engine != p.logical]
    if not pads:
        return t
    if t.logical_shape is not None:
        raise LayoutError(f"engine tensor {t.name!r} is padded already ({t.logical_shape} -> {t.shape})")
    _check(t.name, t.shape, pads)
    shape = list(t.shape)
    for p in pads:
        shape[p.dim] = p.parts * p.engine
    pieces: list[Piece] = []
    for piece in t.pieces:
        cut = _remap(piece.dst_box, pads)
        if len(cut) > 1 and piece.transform != "copy":
            raise LayoutError(
                f"engine tensor {t.name!r}: padding would split a {piece.transform!r} piece of {piece.src!r} "
                f"at a part boundary ({piece.dst_box}); only plain copies can be split"
            )
        for lsub, esub in cut:
            src = piece.src_box if lsub == piece.dst_box else matching_box(piece.dst_box, piece.src_box, lsub)
            pieces.append(Piece(esub, piece.src, src, piece.transform))
    return EngineTensor(t.name, tuple(shape), t.dtype, tuple(pieces), logical_shape=tuple(t.shape))


def logical_to_engine(shape: tuple[int, ...], pads: Sequence[DimPad]) -> list[tuple[Box, Box]]:
    """The whole logical tensor of ``shape`` as (logical box, engine box) pairs: where each
    logical element sits in the engine's padded tensor (to copy a loaded logical tensor in)."""
    pads = [p for p in pads if p.engine != p.logical]
    _check("?", shape, pads)
    return _remap(tuple((0, n) for n in shape), pads)
