"""The span switch and clock: whether this process records spans, and the time they carry.

Spans are stamped in wall-clock nanoseconds (``time.time_ns`` at import, advanced by
``perf_counter_ns``), so spans of one process never go backwards when NTP steps the clock, and
files written by processes on one host line up without any exchange. Processes on different
hosts line up as well as their clocks agree (NTP: ~ms); :func:`fastsync.trace.chrome.merge_files`
takes a per-file offset for the rest.

Off by default: :class:`fastsync.executor.metrics.SyncMetrics` asks :func:`new_spans` once per
sync and records nothing when it returns None, so a stage costs one attribute test.
"""

from __future__ import annotations

import time

__all__ = ["enable", "enabled", "new_spans", "now_ns"]



def _anchor(tries: int = 16) -> tuple[int, int]:
    """(wall ns, perf ns) of one instant: of ``tries`` wall-clock reads, the one its two
    ``perf_counter_ns`` reads bracket most tightly, against their midpoint. Two plain reads one
    after the other are off by however long the process was preempted between them (ms on a loaded
    host), and every span it records after would be off from ``time.time()`` by as much."""
    reads = []
    for _ in range(tries):
        p0 = time.perf_counter_ns()
        w = time.time_ns()
        p1 = time.perf_counter_ns()
        reads.append((p1 - p0, w, (p0 + p1) // 2))
    _, wall, perf = min(reads)
    return wall, perf


_ANCHOR_WALL_NS, _ANCHOR_PERF_NS = _anchor()
_on = False


def now_ns() -> int:
    """Wall-clock nanoseconds, monotonic within this process."""
    return _ANCHOR_WALL_NS + (time.perf_counter_ns() - _ANCHOR_PERF_NS)


def enable(on: bool = True) -> None:
    """Record spans in this process from now on (``on=False`` stops)."""
    global _on
    _on = bool(on)


def enabled() -> bool:
    return _on


def new_spans() -> list[dict] | None:
    """A fresh span list when recording is on, else None (what SyncMetrics keeps per sync)."""
    return [] if _on else None
