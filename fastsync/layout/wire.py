"""The JSON form of one rank's engine tensors: what an engine worker reports over the control plane
and the planner reads back. Engine-neutral; every engine package uses it."""

from __future__ import annotations

from fastsync.layout.box import Box
from fastsync.layout.types import EngineTensor, Piece

__all__ = ["engine_tensors_to_json", "engine_tensors_from_json"]


def _box(b: list) -> Box:
    return tuple((int(s), int(e)) for s, e in b)


def engine_tensors_to_json(tensors: dict[str, EngineTensor]) -> dict:
    return {
        n: [list(t.shape), t.dtype, [[[list(b) for b in p.dst_box], p.src, [list(b) for b in p.src_box], p.transform]
                                     for p in t.pieces]]
        for n, t in sorted(tensors.items())
    }


def engine_tensors_from_json(data: dict) -> dict[str, EngineTensor]:
    out: dict[str, EngineTensor] = {}
    for n, (shape, dtype, pieces) in data.items():
        ps = tuple(Piece(_box(db), src, _box(sb), tf) for db, src, sb, tf in pieces)
        out[n] = EngineTensor(n, tuple(int(x) for x in shape), dtype, ps)
    return out
