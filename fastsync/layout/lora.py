"""Where a LoRA adapter's bytes land in an engine's adapter slot, read back from a recording.

An engine with LoRA keeps, per LoRA layer and per slice ``i`` (one slice per fused sub-module:
``q``/``k``/``v`` of ``qkv_proj``, ``gate``/``up`` of ``gate_up_proj``), stacked tensors
``lora_a_stacked[i][slot, 0]`` (``max_rank x input``) and ``lora_b_stacked[i][slot, 0]``
(``output x max_rank``); its own ``set_lora`` slices PEFT's ``lora_A`` / ``lora_B`` for the
engine rank (column-parallel B by output rows, row-parallel A by input columns) and copies them
into the top-left corner of the slot. Rather than restate that rule per layer kind, the engine
calls its own ``set_lora`` once on *recording* tensors: every source element holds a distinct
number (``1 + offset of its source + flat index``, exact in float64), the slot is float64 zeros,
and what lands says which source element each slot element came from. This module turns such a
recording into :class:`~fastsync.layout.types.Piece` boxes (one per source a destination reads),
refusing anything that is not a box-to-box copy (``fastsync.plan.lora`` plans from them).

Source names are ``{module}.lora_A`` and ``{module}.lora_B`` under the engine's module names
(``model.layers.0.self_attn.q_proj``); PEFT's ``base_model.model.{module}.lora_A.default.weight``
maps to them with :func:`peft_source_name`. B is sent already multiplied by the adapter's scaling
(``alpha / r``): the engine folds the scaling into B when it loads an adapter (vLLM's
``LoRALayerWeights.optimize``), so the slot holds ``B * scaling``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fastsync.errors import LayoutError
from fastsync.layout.types import Piece

__all__ = ["LoraSource", "encode_sources", "recording_inputs", "pieces_from_recording", "peft_source_name",
           "engine_tensor_name"]

#: float64 holds integers exactly up to 2**53: far more source elements than any adapter has.
MAX_RECORDED = 1 << 52

_PEFT = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<kind>[AB])(?:\.(?P<adapter>[^.]+))?\.weight$")


@dataclass(frozen=True, slots=True)
class LoraSource:
    """One source tensor of a recording: its name and full (unsharded) shape."""

    name: str
    shape: tuple[int, int]

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]


def peft_source_name(peft_name: str, adapter: str = "default") -> str | None:
    """``base_model.model.X.lora_A.default.weight`` -> ``X.lora_A``; None for a parameter that
    is not a LoRA matrix of ``adapter`` (the frozen base, another adapter)."""
    m = _PEFT.match(peft_name)
    if m is None or (m.group("adapter") or adapter) != adapter:
        return None
    return f"{m.group('module')}.lora_{m.group('kind')}"


def engine_tensor_name(module: str, kind: str, index: int) -> str:
    """The staging tensor of slice ``index`` of ``module``'s ``lora_a`` / ``lora_b`` stack."""
    if kind not in ("a", "b"):
        raise LayoutError(f"LoRA stack kind must be 'a' or 'b', got {kind!r}")
    return f"{module}.lora_{kind}.{index}"


def encode_sources(sources: Sequence[LoraSource]) -> list[int]:
    """Offsets of each source in the recording's numbering (source k's element j records
    ``1 + offsets[k] + j``); LayoutError when they would not stay exact in float64."""
    offsets, total = [], 0
    for s in sources:
        offsets.append(total)
        total += s.numel
    if total >= MAX_RECORDED:
        raise LayoutError(f"LoRA recording of {total} source elements exceeds float64's exact integers")
    return offsets


def recording_inputs(sources: Sequence[LoraSource]) -> list[torch.Tensor]:
    """One float64 tensor per source, every element its recording number."""
    offsets = encode_sources(sources)
    return [(torch.arange(s.numel, dtype=torch.float64) + (1 + off)).reshape(s.shape)
            for s, off in zip(sources, offsets)]


def pieces_from_recording(dst_name: str, recorded: torch.Tensor, sources: Sequence[LoraSource]
                          ) -> tuple[tuple[int, int], tuple[Piece, ...]]:
    """The region ``set_lora`` wrote into one slot tensor (its top-left ``rows x cols``) and
    the pieces that fill it. ``recorded`` is the slot after the recording (zeros where nothing
    was written). LayoutError naming ``dst_name`` when the written elements are not one
    rectangle from the corner, or a source's elements are not a box copied in order."""
    if recorded.dim() != 2:
        raise LayoutError(f"{dst_name}: recorded slot must be 2-D, got shape {tuple(recorded.shape)}")
    offsets = torch.tensor(encode_sources(sources), dtype=torch.int64)
    vals = recorded.to(torch.float64)
    written = vals != 0
    if not bool(written.any()):
        raise LayoutError(f"{dst_name}: the engine's set_lora wrote nothing into the slot")
    rows = int(written.any(dim=1).nonzero().max()) + 1
    cols = int(written.any(dim=0).nonzero().max()) + 1
    if not bool(written[:rows, :cols].all()):
        raise LayoutError(f"{dst_name}: the written elements are not the {rows}x{cols} corner of the slot")
    ids = vals[:rows, :cols].to(torch.int64) - 1
    which = torch.searchsorted(offsets, ids, right=True) - 1
    pieces: list[Piece] = []
    for k in torch.unique(which).tolist():
        src = sources[k]
        where = (which == k).nonzero()
        r0, c0 = (int(x) for x in where.min(dim=0).values)
        r1, c1 = (int(x) + 1 for x in where.max(dim=0).values)
        h, w = r1 - r0, c1 - c0
        flat = ids[r0:r1, c0:c1] - int(offsets[k])
        if where.shape[0] != h * w or not bool((which[r0:r1, c0:c1] == k).all()):
            raise LayoutError(f"{dst_name}: the elements from {src.name} are not one rectangle")
        sr, sc = divmod(int(flat[0, 0]), src.shape[1])
        want = (torch.arange(h).view(-1, 1) + sr) * src.shape[1] + (torch.arange(w).view(1, -1) + sc)
        if sr + h > src.shape[0] or sc + w > src.shape[1] or not bool((flat == want).all()):
            raise LayoutError(f"{dst_name}: {src.name}'s elements are not a box of it copied in order")
        pieces.append(Piece(((r0, r1), (c0, c1)), src.name, ((sr, sr + h), (sc, sc + w))))
    return (rows, cols), tuple(pieces)
