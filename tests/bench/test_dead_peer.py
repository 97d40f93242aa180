"""A killed engine rank mid-benchmark: the survivors name it within seconds (heartbeats through
the control store, not the sync deadline), every process ends within 10 s of the kill, the
surviving engine rank keeps its last complete version, and the benchmark still reports the
versions it completed."""

from __future__ import annotations

import pytest

from fastsync.bench.harness import run_bench
from fastsync.bench.workers import WorkerConfig


@pytest.mark.slow
def test_killed_engine_rank_is_named_and_everyone_ends_quickly() -> None:
    # deadlines far above the 10 s asked: only liveness can end the run that fast
    cfg = WorkerConfig(trainers=2, rollouts=2, port=0, size_bytes=2 << 20, timeout_s=60.0,
                       kill_engine_at=(1, 3))
    result = run_bench(cfg, ["nixl"], steps=3, warmup=1, progress=False)
    failure = result["error"]
    assert failure is not None, result
    assert failure["killed"] == [{"role": "engine", "rank": 1, "version": 3}]
    assert failure["all_ended_s_after_kill"] < 10.0, failure
    assert failure["killed_at_exit"] == [], failure  # none had to be killed by the parent
    text = failure["error"] + " ".join(failure["worker_errors"])
    assert "engine rank 1" in text and "died" in text, failure
    # versions 1 (warm-up) and 2 (timed) completed and are still reported
    assert result["completed_versions"] == [1, 2]
    assert result["transports"]["nixl"]["seconds_all"], result["transports"]["nixl"]
    # the surviving engine rank refused version 3 and kept serving version 2
    errs = result["transports"]["nixl"]["errors"]
    assert any(e.startswith("v3 engine 0:") and "keeping version 2" in e for e in errs), errs
    assert any(e.startswith("v3 trainer") and "engine rank 1" in e for e in errs), errs
