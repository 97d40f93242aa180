"""A ``NameMap`` as JSON: how a worker that recorded its layout hands it to a test or a trainer."""

from __future__ import annotations

import json

from fastsync.errors import LayoutError
from fastsync.layout.namemap import EngineParam, NameMap, Part, Segment

__all__ = ["name_map_to_json", "name_map_from_json"]


def name_map_to_json(nm: NameMap) -> str:
    return json.dumps({
        "architecture": nm.architecture, "engine": nm.engine, "unused": nm.unused, "engine_only": nm.engine_only,
        "params": [{"name": p.name, "shape": list(p.shape), "style": p.style, "shard_dim": p.shard_dim,
                    "parts": [[q.size, q.heads] for q in p.parts], "expert_dim": p.expert_dim,
                    "quantizable": p.quantizable, "dtype": p.dtype,
                    "segments": [[s.src, [list(x) for x in s.src_box], [list(x) for x in s.dst_box]]
                                 for s in p.segments]} for p in nm.params]})


def _box(raw: list) -> tuple[tuple[int, int], ...]:
    return tuple((int(a), int(b)) for a, b in raw)


def name_map_from_json(raw: str) -> NameMap:
    try:
        d = json.loads(raw)
        params = [EngineParam(p["name"], tuple(int(x) for x in p["shape"]), p["style"],
                              tuple(Segment(src, _box(sb), _box(db)) for src, sb, db in p["segments"]),
                              shard_dim=int(p["shard_dim"]), parts=tuple(Part(int(a), int(b)) for a, b in p["parts"]),
                              expert_dim=p["expert_dim"], quantizable=bool(p["quantizable"]), dtype=p["dtype"])
                  for p in d["params"]]
        return NameMap(d["architecture"], d["engine"], params, dict(d["unused"]), dict(d["engine_only"]))
    except (KeyError, TypeError, ValueError) as e:
        raise LayoutError(f"not a name map in JSON: {type(e).__name__}: {e}") from e
