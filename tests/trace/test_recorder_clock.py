"""The span clock's anchor (``fastsync/trace/recorder.py``): spans are stamped in wall-clock
nanoseconds advanced by ``perf_counter_ns``, so the anchor must read both clocks at one instant.
A process preempted between two plain reads (a loaded host) would stamp every span it records off
from ``time.time()``, which stamps each sync's start and end, by as long as it waited: a trace's
sync slice then stuck out of its reported time (``tests/trace/test_bench_trace.py`` failed once by
0.8 ms). The anchor takes the wall read its two perf reads bracket most tightly."""

from __future__ import annotations

import time

from fastsync.trace import recorder


def test_anchor_takes_the_wall_read_the_perf_reads_bracket_most_tightly(monkeypatch):
    # three tries on fake clocks: the first preempted 5 ms between its reads, the second 1 us, the third 3 us
    perf = iter([0, 5_000_000, 6_000_000, 6_001_000, 7_000_000, 7_003_000])
    wall = iter([1_000_000_000_000, 1_000_006_000_000, 1_000_007_000_000])
    monkeypatch.setattr(time, "perf_counter_ns", lambda: next(perf))
    monkeypatch.setattr(time, "time_ns", lambda: next(wall))
    w, p = recorder._anchor(tries=3)
    assert (w, p) == (1_000_006_000_000, 6_000_500)  # the second try's wall read, its perf midpoint

