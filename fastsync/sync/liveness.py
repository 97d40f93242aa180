"""Liveness of peers through the control plane: a killed rank is named within seconds.

Every trainer and engine rank runs a :class:`Heartbeat` from ``setup()`` until ``close()``: a
daemon thread that increments ``alive/{role}/{rank}`` every ``period_s``. A waiting rank holds a
:class:`PeerWatch` over the peers it depends on and calls :meth:`PeerWatch.check` while it
waits; a peer whose counter stopped moving for ``stale_s`` (its process was killed, or hangs
with its interpreter frozen) raises SyncError naming that rank, long before the sync's own
deadline. Counters, not clocks: each watcher measures staleness on its own monotonic clock, so
hosts need not agree on the time. A peer that never beat (still starting) is not judged; the
wait's deadline covers it.
"""

from __future__ import annotations

import threading
import time

from fastsync.control import ControlPlane
from fastsync.errors import SyncError

__all__ = ["Heartbeat", "PeerWatch", "alive_key", "HEARTBEAT_PERIOD_S", "STALE_AFTER_S", "wait_key"]

#: How often a rank beats.
HEARTBEAT_PERIOD_S = 0.25
#: How long a counter may stand still before its rank counts as dead (many missed beats: a busy
#: host delays a beat, it does not stop them).
STALE_AFTER_S = 2.0


def alive_key(role: str, rank: int) -> str:
    """Control-plane key of ``role`` (``"trainer"`` or ``"engine"``) rank ``rank``'s heartbeat."""
    return f"alive/{role}/{rank}"


class Heartbeat:
    """Beat ``alive/{role}/{rank}`` on a daemon thread until :meth:`stop`."""

    def __init__(self, control: ControlPlane, role: str, rank: int, period_s: float = HEARTBEAT_PERIOD_S) -> None:
        self.control, self.key, self.period_s = control, alive_key(role, rank), period_s
        self._stop = threading.Event()
        self.errors, self.last_error = 0, ""
        self.control.add(self.key, 1)
        self._thread = threading.Thread(target=self._run, name=f"fastsync-heartbeat-{role}{rank}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                self.control.add(self.key, 1)
            except Exception as e:  # a store hiccup: the next beat retries; a store gone ends the job anyway
                self.errors += 1
                self.last_error = f"{type(e).__name__}: {e}"

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * self.period_s + 1.0)


class PeerWatch:
    """Watch the heartbeats of ``peers`` (``[(role, rank), ...]``); :meth:`check` raises
    SyncError naming a peer whose heartbeat stopped. A daemon thread samples the counters every
    ``sample_s`` (so staleness is known the moment a wait asks, not measured from then on);
    :meth:`check` only reads what it saw."""

    def __init__(self, control: ControlPlane, peers: list[tuple[str, int]], *, who: str,
                 stale_s: float = STALE_AFTER_S, sample_s: float = HEARTBEAT_PERIOD_S) -> None:
        self.control, self.who, self.stale_s, self.sample_s = control, who, stale_s, sample_s
        self.peers = list(peers)
        self._seen: dict[tuple[str, int], tuple[int, float]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.errors, self.last_error = 0, ""
        self._thread: threading.Thread | None = None
        if self.peers:
            self._thread = threading.Thread(target=self._run, name=f"fastsync-peerwatch-{who}", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.sample_s):
            try:
                self.sample()
            except Exception as e:  # a store hiccup: sample again next period
                self.errors += 1
                self.last_error = f"{type(e).__name__}: {e}"

    def sample(self) -> None:
        """Read every peer's counter once, noting when each last moved."""
        now = time.monotonic()
        for peer in self.peers:
            count = self.control.add(alive_key(*peer), 0)
            with self._lock:
                prev = self._seen.get(peer)
                if prev is None or count != prev[0]:
                    self._seen[peer] = (count, now)

    def dead(self) -> list[tuple[str, int, float]]:
        """``(role, rank, seconds since its last beat)`` of every peer counted as dead now."""
        now = time.monotonic()
        with self._lock:
            return [(p[0], p[1], now - t) for p, (count, t) in self._seen.items()
                    if count > 0 and now - t > self.stale_s]

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.sample_s + 1.0)

    def check(self, during: str = "") -> None:
        gone = self.dead()
        if gone:  # confirm with a fresh read: a replacement process may have beaten since the last sample
            self.sample()
            gone = self.dead()
        if gone:
            names = ", ".join(f"{role} rank {rank} (no heartbeat for {s:.1f} s)" for role, rank, s in gone)
            raise SyncError(f"{self.who}: {names} is dead or hung{' ' + during if during else ''}: its process "
                            f"was killed or stopped responding")


def wait_key(control: ControlPlane, key: str, deadline: float, what: str, watch: PeerWatch | None) -> bytes:
    """``control.get`` that also gives up as soon as ``watch`` names a dead peer."""
    while True:
        left = deadline - time.monotonic()
        got = control.try_get(key)
        if got is not None:
            return got
        if watch is not None:
            watch.check(f"while waiting for {what}")
        if left <= 0:
            raise SyncError(f"control plane: {what} did not publish {key!r} by the deadline")
        time.sleep(min(0.002, max(left, 0.0)))
