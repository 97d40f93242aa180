"""The pipelined send loop: pack chunk k+1 while the WRITE of chunk k is in flight.

Order on the calling thread, per chunk k: wait until k is packed, drain k-1 (its slot becomes
free, so the helper starts packing k+1), post k. So one chunk is written while the next is
packed, whether the transport copies inside ``post`` (NIXL over cma) or in the background
until ``drain`` (gloo, RDMA).

With ``in_flight=d`` up to ``d`` chunks are written at once: chunk ``k`` is posted once ``k-d``
drained (``d=1``, the default, is the order above). Where each write's completion waits on a long
round trip (a slow link whose queue also holds the acknowledgements: a relaying engine that
forwards while it receives), one chunk in flight leaves the link idle between chunks.

Staging is split into slots (two by default); chunk ``k`` packs into slot ``k % num_slots`` once
the previous chunk that used that slot has drained (its writes completed), so staging memory
stays bounded by the budget whatever the model size. Packing runs on a helper thread (torch's
copy kernels release the GIL); posting and draining stay on the calling thread, which is the
only one that touches the transport. Every wait is bounded by the sync's deadline.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from fastsync.errors import SyncError
from fastsync.executor.metrics import SyncMetrics
from fastsync.executor.program import Chunk

__all__ = ["run_pipelined"]


#: How often the calling thread drives the transport while it waits for packing (``progress``).
PROGRESS_EVERY_S = 0.002


def _wait(ev: threading.Event, deadline: float, what: str, failed: list[BaseException],
          progress: Callable[[], None] | None = None) -> None:
    nap = 0.01 if progress is None else PROGRESS_EVERY_S
    while not ev.wait(nap):
        if failed:
            raise failed[0]
        if time.monotonic() >= deadline:
            raise SyncError(f"timed out waiting for {what}")
        if progress is not None:
            progress()


def run_pipelined(
    chunks: list[Chunk],
    *,
    pack: Callable[[Chunk], None],
    post: Callable[[Chunk], None],
    drain: Callable[[Chunk, float], None],
    deadline: float,
    metrics: SyncMetrics,
    overlap: bool = True,
    on_chunk: Callable[[int], None] | None = None,
    in_flight: int = 1,
    progress: Callable[[], None] | None = None,
    on_posted: Callable[[], None] | None = None,
) -> None:
    """Run ``pack -> post -> drain`` over ``chunks`` with packing overlapped with writes.

    ``drain(chunk, deadline)`` must return only when the chunk's staging slot may be reused.
    Stage seconds land in ``metrics``: ``pack`` (helper thread), ``wait_pack`` (main thread
    stalled on packing), ``post`` and ``drain``. ``in_flight``: chunks written at once (see the
    module docstring). ``progress``: called every :data:`PROGRESS_EVERY_S` while the calling
    thread waits for a chunk's packing, for transports whose posted writes move only while the
    sender drives them (UCX over TCP: without it the writes already posted stall while the next
    chunk packs). ``on_posted``: called once, after the last chunk is posted and before it is
    drained (every chunk is packed by then).
    """
    if in_flight < 1:
        raise SyncError(f"run_pipelined: in_flight must be >= 1, got {in_flight}")
    n = len(chunks)
    if not overlap:
        for k, c in enumerate(chunks):
            with metrics.stage("pack"):
                pack(c)
            with metrics.stage("post"):
                post(c)
            if k == n - 1 and on_posted is not None:
                on_posted()
            with metrics.stage("drain"):
                drain(c, deadline)
            if on_chunk is not None:
                on_chunk(c.index)
        return

    prev_same_slot: list[int] = []
    last: dict[int, int] = {}
    for k, c in enumerate(chunks):
        prev_same_slot.append(last.get(c.slot, -1) if c.slot >= 0 else -1)
        if c.slot >= 0:
            last[c.slot] = k
    packed = [threading.Event() for _ in range(n)]
    drained = [threading.Event() for _ in range(n)]
    failed: list[BaseException] = []
    stop = threading.Event()

    def packer() -> None:
        try:
            for k, c in enumerate(chunks):
                j = prev_same_slot[k]
                if j >= 0:
                    while not drained[j].wait(0.01):
                        if stop.is_set():
                            return
                with metrics.stage("pack"):
                    pack(c)
                packed[k].set()
        except BaseException as e:  # handed to the main thread, which raises it
            failed.append(e)

    th = threading.Thread(target=packer, name="fastsync-packer", daemon=True)
    th.start()
    upto = -1  # chunks 0..upto drained, in order

    def drain_through(j: int) -> None:
        nonlocal upto
        while upto < j:
            upto += 1
            if not drained[upto].is_set():
                with metrics.stage("drain"):
                    drain(chunks[upto], deadline)
                drained[upto].set()

    try:
        for k, c in enumerate(chunks):
            # the slot chunk k packs into must be free first (only binds when in_flight >= slots)
            drain_through(min(prev_same_slot[k], k - 1))
            with metrics.stage("wait_pack"):
                _wait(packed[k], deadline, f"packing of chunk {k}", failed, progress)
            # Drain k-in_flight before posting k: with one in flight this frees k-1's slot so
            # chunk k+1 packs while k is written (with cma, NIXL copies inside transfer(), so
            # the write of k is the post itself).
            drain_through(k - in_flight)
            with metrics.stage("post"):
                post(c)
            if k == n - 1 and on_posted is not None:  # before on_chunk's checks: the engines may be waiting
                on_posted()
            if on_chunk is not None:
                on_chunk(k)
        drain_through(n - 1)
    finally:
        stop.set()
        th.join(timeout=max(0.0, deadline - time.monotonic()) + 1.0)
    if failed:
        raise failed[0]
