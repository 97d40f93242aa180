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


@pytest.mark.parametrize(("in_flight", "slots"), [(1, 2), (3, 2), (4, -1)])
def test_in_flight_chunks_are_bounded_and_drained_in_order(in_flight: int, slots: int) -> None:
    """``in_flight=d``: chunk k is posted only after k-d drained (never more than d written at
    once), drains run in chunk order, a staging slot is still reused only after its previous
    chunk drained (d above the slot count must not deadlock), and with direct chunks (slot -1,
    no staging) d chunks really are in flight together."""
    events: list[tuple[str, int]] = []
    lock = threading.Lock()
    most = [0]

    def log(kind: str):
        def f(c: Chunk, *_: object) -> None:
            time.sleep(0.002)
            with lock:
                events.append((kind, c.index))
                posted = sum(1 for e in events if e[0] == "post")
                drained = sum(1 for e in events if e[0] == "drain")
                most[0] = max(most[0], posted - drained)
        return f

    chunks = [Chunk(i, i % slots if slots > 0 else -1) for i in range(10)]
    run_pipelined(chunks, pack=log("pack"), post=log("post"), drain=log("drain"),
                  deadline=time.monotonic() + 10, metrics=SyncMetrics(1, "trainer", 0, "test"), in_flight=in_flight)
    pos = {e: i for i, e in enumerate(events)}
    assert [k for kind, k in events if kind == "drain"] == list(range(10))
    for k in range(10):
        assert pos[("pack", k)] < pos[("post", k)] < pos[("drain", k)]
        if k >= in_flight:
            assert pos[("drain", k - in_flight)] < pos[("post", k)]
        if slots > 0 and k >= slots:
            assert pos[("drain", k - slots)] < pos[("pack", k)]
    assert most[0] <= in_flight
    if slots < 0:
        assert most[0] == in_flight


def test_in_flight_below_one_is_refused() -> None:
    with pytest.raises(SyncError, match="in_flight"):
        run_pipelined(_chunks(2), pack=lambda c: None, post=lambda c: None, drain=lambda c, d: None,
                      deadline=time.monotonic() + 10, metrics=SyncMetrics(1, "trainer", 0, "test"), in_flight=0)


def test_progress_drives_posted_writes_while_the_next_chunk_packs() -> None:
    """A transport whose posted writes move only while the sender drives them (UCX over TCP) gets
    ``progress`` calls while the calling thread waits for packing, after the previous chunk is
    posted, and none once every chunk is packed in time."""
    posted: list[int] = []
    calls: list[tuple[int, ...]] = []

    def slow_pack(c: Chunk) -> None:
        if c.index:
            time.sleep(0.05)

    m = SyncMetrics(1, "trainer", 0, "test")
    run_pipelined(_chunks(3), pack=slow_pack, post=lambda c: posted.append(c.index), drain=lambda c, dl: None,
                  deadline=time.monotonic() + 10, metrics=m, progress=lambda: calls.append(tuple(posted)))
    assert posted == [0, 1, 2]
    # every 2 ms while chunk 1 packs (chunk 0 posted) and while chunk 2 packs (chunks 0 and 1 posted)
    assert calls.count((0,)) >= 3 and calls.count((0, 1)) >= 3
    assert set(calls) <= {(), (0,), (0, 1)}

    calls.clear()
    run_pipelined(_chunks(3), pack=lambda c: None, post=lambda c: None, drain=lambda c, dl: None,
                  deadline=time.monotonic() + 10, metrics=m, progress=lambda: calls.append(()))
    assert len(calls) <= 3  # packing keeps ahead: at most a call per chunk raced with its packer


@pytest.mark.parametrize("overlap", [True, False])
def test_on_posted_runs_once_after_every_pack_and_post_before_the_last_drain(overlap: bool) -> None:
    """The sender publishes its digests from ``on_posted``: every chunk is packed (digested) by
    then, and the engines need not wait for the sender to see its last writes complete."""
    events: list[tuple[str, int]] = []
    lock = threading.Lock()

    def log(kind: str):
        def f(c: Chunk, *_: object) -> None:
            with lock:
                events.append((kind, c.index))
        return f

    run_pipelined(_chunks(5), pack=log("pack"), post=log("post"), drain=log("drain"),
                  deadline=time.monotonic() + 10, metrics=SyncMetrics(1, "trainer", 0, "test"), overlap=overlap,
                  on_posted=lambda: events.append(("posted", -1)))
    assert events.count(("posted", -1)) == 1
    at = events.index(("posted", -1))
    assert all(("pack", k) in events[:at] and ("post", k) in events[:at] for k in range(5))
    assert ("drain", 4) in events[at:]
