"""Per-sync measurements: seconds per stage and bytes per link, recorded on every rank."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from collections.abc import Iterator

from fastsync.trace.recorder import new_spans, now_ns

__all__ = ["SyncMetrics"]


@dataclass(slots=True)
class SyncMetrics:
    """What one rank saw of one sync. ``stages`` accumulate seconds; ``bytes_per_link`` is keyed
    ``"t{src}->r{dst}"``. ``start``/``end`` are wall-clock (``time.time()``) so ranks on one host
    can be lined up. ``spans`` (only while :func:`fastsync.trace.enable` is on, else None) keeps
    every stage as ``{name, ts_ns, dur_ns, thread}`` for a trace (``fastsync.trace.chrome``)."""

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
    spans: list[dict] | None = field(default_factory=new_spans)

    @property
    def seconds(self) -> float:
        return max(0.0, self.end - self.start)

    def add(self, stage: str, seconds: float) -> None:
        self.stages[stage] = self.stages.get(stage, 0.0) + seconds

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        if self.spans is None:
            t0 = time.perf_counter()
            try:
                yield
            finally:
                self.add(name, time.perf_counter() - t0)
            return
        s0 = now_ns()
        try:
            yield
        finally:
            dur = now_ns() - s0
            self.add(name, dur / 1e9)
            self.spans.append({"name": name, "ts_ns": s0, "dur_ns": dur, "thread": threading.current_thread().name})

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
            **({"spans": list(self.spans)} if self.spans is not None else {}),
        }
