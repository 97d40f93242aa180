"""``run_ranks``: results in order, the first failure re-raised, a hung rank named."""

from __future__ import annotations

import threading

import pytest

from fastsync_rigs.threads import run_ranks


def test_results_in_rank_order_and_concurrent():
    barrier = threading.Barrier(3, timeout=10)  # only passes if all three run at once

    def rank(i: int):
        barrier.wait()
        return i * 10

    assert run_ranks([lambda i=i: rank(i) for i in range(3)]) == [0, 10, 20]


def test_first_failure_is_reraised():
    def bad():
        raise ValueError("rank 1 broke")

    with pytest.raises(ValueError, match="rank 1 broke"):
        run_ranks([lambda: 1, bad])


def test_hung_rank_is_named():
    never = threading.Event()
    try:
        with pytest.raises(TimeoutError, match=r"rank\(s\) \[1\]"):
            run_ranks([lambda: 1, lambda: never.wait(30)], timeout_s=0.2)
    finally:
        never.set()
