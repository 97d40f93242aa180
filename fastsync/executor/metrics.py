"""Per-sync measurements: seconds per stage and bytes per link, recorded on every rank."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from collections.abc import Iterator

__all__ = ["SyncMetrics"]


@dataclass(slots=True)
class SyncMetrics:
    """What one rank saw of one sync. ``stages`` accumulate seconds; ``bytes_per_link`` is keyed
    ``"t{src}->r{dst}"``. ``start``/``end`` are wall-clock (``time.time()``) so ranks on one host
    can be lined up."""

    version: int
    role: str
    rank: int
    transport: str
    start: float = 0.0
    end: float = 0.0
    stages: dict[str, float] = field(default_factory=dict)
    bytes_per_link: dict[str, int] = field(default_factory=dict)
    ok: bool = False
    error: str = ""

    @property
    def seconds(self) -> float:
        return max(0.0, self.end - self.start)

    def add(self, stage: str, seconds: float) -> None:
        self.stages[stage] = self.stages.get(stage, 0.0) + seconds

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0)

    def to_json(self) -> dict:
        return {
            "version": self.version,
            "role": self.role,
            "rank": self.rank,
            "transport": self.transport,
            "start": self.start,
            "end": self.end,
            "seconds": self.seconds,
            "stages": dict(self.stages),
            "bytes_per_link": dict(self.bytes_per_link),
            "ok": self.ok,
            "error": self.error,
        }
