"""The trainer side's contract with engines: :class:`EngineHandle`, the five calls
:class:`~fastsync.sync.weight_sync.WeightSync` drives an inference engine through (vLLM's are in
``fastsync.engines.vllm.handle``), and :class:`SyncResult`, what one sync returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

__all__ = ["EngineHandle", "SyncResult"]


class EngineHandle(Protocol):
    """What WeightSync needs from an inference engine (see ``fastsync.engines.vllm.handle``)."""

    def describe(self, options: dict | None = None) -> list[dict]: ...

    def connect(self, plan_json: str, options: dict) -> list[dict]: ...

    def begin_update(self, version: int, timeout_s: float = 60.0) -> int: ...

    def wait_update(self, token: int, timeout_s: float = 60.0) -> list[dict]: ...

    def version(self) -> int: ...


@dataclass(slots=True)
class SyncResult:
    """One sync as trainer rank ``rank`` saw it. ``seconds``: from the call until every engine
    this rank writes to flipped (on rank 0: until every engine finished post-processing)."""

    version: int
    rank: int
    seconds: float
    metrics: dict
    engines: list[list[dict]] = field(default_factory=list)

    @property
    def fallback(self) -> dict:
        """Tensors and bytes the engines took through their own loader (vLLM's ``load_weights``)
        instead of in place, summed over the engine ranks that said (trainer rank 0 hears them)."""
        ranks = [r.get("fallback") for e in self.engines for r in e if isinstance(r, dict) and r.get("fallback")]
        return {"tensors": sum(f["tensors"] for f in ranks), "bytes": sum(f["bytes"] for f in ranks),
                "names": sorted({n for f in ranks for n in f.get("names", [])})[:8], "engine_ranks": len(ranks)}
