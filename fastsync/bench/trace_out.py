"""The measured side of ``fastsync bench --trace``: every process's phases of every sync (recorded
with spans on, returned with its row) as one Chrome trace on the host's wall clock.

The bench's processes share one host, so their ``time.time_ns``-anchored spans are on one clock
already; each sync's slice on each rank runs from that rank's start to its end, and the wall time
the benchmark reports for a version (``max(end) - min(start)`` over its ranks) is the span of that
version's slices.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

from fastsync.trace import chrome

__all__ = ["bench_trace", "write_bench_trace"]


def bench_trace(rows: Sequence[dict], schedule: Sequence[tuple[str, int, bool]], *, title: str = "") -> dict:
    """The trace of the sync rows (``kind == "sync"``) of one benchmark run."""
    syncs = [r for r in rows if r.get("kind") == "sync" and "start" in r and "end" in r]
    per_v: dict[int, list[dict]] = defaultdict(list)
    for r in syncs:
        per_v[r["version"]].append(r)
    seconds = {str(v): max(r["end"] for r in rs) - min(r["start"] for r in rs) for v, rs in sorted(per_v.items())}
    b = chrome.TraceBuilder(kind="measured", title=title, seconds_per_version=seconds,
                            schedule=[list(s) for s in schedule])
    chrome.metrics_slices(b, syncs)
    return b.build()


def _plotted_versions(schedule: Sequence[tuple[str, int, bool]], warmup: int) -> tuple[str, list[int]]:
    """The figure shows one transport's timed syncs (nixl if run, else the first): with several
    transports the warm-ups and the other transports' set-up would dwarf them."""
    names = [n for n, _, _ in schedule]
    if not names:
        return "", []
    name = "nixl" if "nixl" in names else names[0]
    mine = [(v, verify) for n, v, verify in schedule if n == name]
    return name, [v for v, verify in mine[warmup:] if not verify]


def write_bench_trace(path: str | Path | None, rows: Sequence[dict], schedule: Sequence[tuple[str, int, bool]], *,
                      title: str = "", plot: str | Path | None = None, warmup: int = 1) -> dict:
    """Write the trace (and, with ``plot``, a timeline figure of it); returns the trace."""
    trace = bench_trace(rows, schedule, title=title)
    if path is not None:
        chrome.write(path, trace)
    if plot is not None:
        from fastsync.trace.plot import plot_timeline

        shown = _plotted_versions(schedule, warmup)
        plot_timeline(plot, trace, title=f"{title}\n{shown[0]}: timed syncs v{shown[1][0]}-v{shown[1][-1]}"
                      if shown[1] else title, versions=shown[1] or None)
    return trace
