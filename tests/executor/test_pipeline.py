"""The pipelined send loop: bounded staging (slot reuse only after drain), overlap, errors, deadlines."""

from __future__ import annotations

import threading
import time

import pytest

from fastsync.errors import SyncError
from fastsync.executor.metrics import SyncMetrics
from fastsync.executor.pipeline import run_pipelined
from fastsync.executor.program import Chunk


def _chunks(n: int, slots: int = 2) -> list[Chunk]:
    return [Chunk(i, i % slots) for i in range(n)]


@pytest.mark.parametrize("overlap", [True, False])
def test_slot_is_reused_only_after_its_previous_chunk_drained(overlap: bool) -> None:
    events: list[tuple[str, int]] = []
    lock = threading.Lock()

    def log(kind: str):
        def f(c: Chunk, *_: object) -> None:
            time.sleep(0.002)
            with lock:
                events.append((kind, c.index))
        return f

    m = SyncMetrics(1, "trainer", 0, "test")
    run_pipelined(_chunks(6), pack=log("pack"), post=log("post"), drain=log("drain"),
                  deadline=time.monotonic() + 10, metrics=m, overlap=overlap)
    pos = {e: i for i, e in enumerate(events)}
    for k in range(6):
        assert pos[("pack", k)] < pos[("post", k)] < pos[("drain", k)]
        if k >= 2:
            assert pos[("drain", k - 2)] < pos[("pack", k)]
    assert {"post", "drain"} <= set(m.stages)


@pytest.mark.parametrize("write_in", ["post", "drain"])
def test_pack_overlaps_the_write_of_the_previous_chunk(write_in: str) -> None:
    """The write of chunk k (inside post, as NIXL over cma does it, or between post and drain,
    as an asynchronous transport does) overlaps the packing of chunk k+1."""
    active = {"pack": 0, "write": 0}
    overlapped = []
    lock = threading.Lock()

    def pack(c: Chunk) -> None:
        with lock:
            active["pack"] += 1
        time.sleep(0.01)
        with lock:
            overlapped.append(active["write"] > 0)
            active["pack"] -= 1

    def write(c: Chunk, *_: object) -> None:
        with lock:
            active["write"] += 1
        time.sleep(0.02)
        with lock:
            active["write"] -= 1

    inflight: dict[int, threading.Thread] = {}

    def post_async(c: Chunk) -> None:  # the write runs in the background until drained
        inflight[c.index] = threading.Thread(target=write, args=(c,))
        inflight[c.index].start()

    def drain_async(c: Chunk, dl: float) -> None:
        inflight.pop(c.index).join()

    if write_in == "post":
        post, drain = write, (lambda c, dl: None)
    else:
        post, drain = post_async, drain_async
    run_pipelined(_chunks(5), pack=pack, post=post, drain=drain, deadline=time.monotonic() + 10,
                  metrics=SyncMetrics(1, "trainer", 0, "test"))
    assert sum(overlapped) >= 2


def test_pack_error_reaches_the_caller() -> None:
    def pack(c: Chunk) -> None:
        if c.index == 2:
            raise ValueError("bad transform")

    with pytest.raises(ValueError, match="bad transform"):
        run_pipelined(_chunks(4), pack=pack, post=lambda c: None, drain=lambda c, d: None,
                      deadline=time.monotonic() + 10, metrics=SyncMetrics(1, "trainer", 0, "test"))


def test_stalled_pack_fails_by_the_deadline() -> None:
    t0 = time.monotonic()
    with pytest.raises(SyncError, match="packing of chunk 0"):
        run_pipelined(_chunks(2), pack=lambda c: time.sleep(2), post=lambda c: None, drain=lambda c, d: None,
                      deadline=time.monotonic() + 0.3, metrics=SyncMetrics(1, "trainer", 0, "test"))
    assert time.monotonic() - t0 < 3
