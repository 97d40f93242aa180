"""Rows from benchmark worker processes, gathered by their parent with a deadline.

Every worker puts dicts on one queue: its results (any ``kind``), ``{"kind": "exit"}`` when it is
done, or ``{"kind": "crash", "role", "rank", "error", "trace"}``. The parent reads them until it
has what it waits for, and meanwhile watches for a worker that died without a word (a segfault,
the OOM killer), so no wait outlives its deadline or a dead worker. Used by ``fastsync bench``
(``harness.Cluster``), ``fastsync delta-bench`` and the tests' delta jobs.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Mapping
from typing import Any

from fastsync.errors import SyncError

__all__ = ["KILLED_ON_PURPOSE", "collect_rows", "exits"]

#: The exit code of a worker a fault test kills on purpose (``os._exit``): not a failure.
KILLED_ON_PURPOSE = 17


def exits(rows: list[dict]) -> int:
    """How many workers said they are done."""
    return sum(r.get("kind") == "exit" for r in rows)


def collect_rows(results: Any, procs: Mapping[str, Any], *, done: Callable[[list[dict]], bool], timeout_s: float,
                 what: str, rows: list[dict] | None = None, on_row: Callable[[dict], None] | None = None,
                 poll_s: float = 1.0) -> list[dict]:
    """Append the rows of ``results`` (a multiprocessing queue) to ``rows`` until ``done(rows)``.
    SyncError naming ``what`` at ``timeout_s``, for a crash row (the worker's role, rank, error
    and trace), or for a worker of ``procs`` (name -> process) that exited with a code other than
    0 or :data:`KILLED_ON_PURPOSE`."""
    rows = [] if rows is None else rows
    deadline = time.monotonic() + timeout_s
    while not done(rows):
        left = deadline - time.monotonic()
        if left <= 0:
            raise SyncError(f"{what} did not finish within {timeout_s:.0f} s ({len(rows)} results so far)")
        try:
            row = results.get(timeout=min(left, poll_s))
        except queue.Empty:
            dead = [f"{name} (exit {p.exitcode})" for name, p in procs.items()
                    if p.exitcode not in (None, 0, KILLED_ON_PURPOSE)]
            if dead:
                raise SyncError(f"{what}: worker(s) died: {', '.join(dead)}") from None
            continue
        if row.get("kind") == "crash":
            who = f"{row.get('role', 'worker')}" + (f" rank {row['rank']}" if "rank" in row else "")
            raise SyncError(f"{what}: {who} crashed: {row['error']}\n{row.get('trace', '')}")
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows
