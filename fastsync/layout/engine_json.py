"""The JSON form of one rank's engine tensors: what an engine worker reports over the control plane
and the planner reads back. Engine-neutral; every engine package uses it."""

from __future__ import annotations

from fastsync.layout.box import Box
from fastsync.layout.types import EngineTensor, Piece

__all__ = ["engine_tensors_to_json", "engine_tensors_from_json"]


def _box(b: list) -> Box:
    return tuple((int(s), int(e)) for s, e in b)


def engine_tensors_to_json(tensors: dict[str, EngineTensor]) -> dict:
    """``{name: [shape, dtype, pieces(, logical_shape)]}``; the logical shape only where the
    engine pads the tensor (``shape`` is then the engine's, the pieces in its coordinates)."""
    return {n: t.to_json() for n, t in sorted(tensors.items())}


def engine_tensors_from_json(data: dict) -> dict[str, EngineTensor]:
    out: dict[str, EngineTensor] = {}
    for n, row in data.items():
        shape, dtype, pieces = row[:3]
        logical = tuple(int(x) for x in row[3]) if len(row) > 3 and row[3] is not None else None
        ps = tuple(Piece(_box(db), src, _box(sb), tf) for db, src, sb, tf in pieces)
        out[n] = EngineTensor(n, tuple(int(x) for x in shape), dtype, ps, logical)
    return out
