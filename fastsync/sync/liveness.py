"""Liveness of peers through the control plane: a killed rank is named at once; a silent one
(hung, or its host cut off) is left to the sync's deadline and named there.

Every trainer and engine rank runs a :class:`Heartbeat` from ``setup()`` until ``close()``: a
daemon thread on its own connection to the store (so it never queues behind the sync's requests)
that increments ``alive/{role}/{rank}`` every ``period_s``. At start it publishes a fresh token
(``alive/{role}/{rank}/token``) and asks the store to set ``alive/{role}/{rank}/gone`` to that
token when the connection ends without a clean close: the kernel closes a killed process's
sockets, so the store learns of the death within a round trip.

A waiting rank holds a :class:`PeerWatch` over the peers it depends on and calls
:meth:`PeerWatch.check` while it waits:

* a peer whose death notice carries its current token is **dead**: SyncError at once, naming it
  (a replacement process publishes a new token and counts as alive);
* a peer whose counter stood still for ``stale_s`` is **silent**: hung, or its host cannot reach
  the store (a cut link looks exactly like this from the other side). That is not a reason to
  fail early, since a link that comes back inside the deadline must let the version complete;
  :meth:`PeerWatch.silent_note` names such peers for the message the deadline raises;
* while the watcher itself cannot reach the store it judges nobody (it knows nothing new) and
  :meth:`PeerWatch.silent_note` says so.

Counters, not clocks: each watcher measures silence on its own monotonic clock, so hosts need
not agree on the time. A peer that never beat (still starting) is not judged.
"""

from __future__ import annotations

import os
import threading
import time

from fastsync.control import ControlPlane, StoreUnreachable
from fastsync.errors import FastSyncError, SyncError
from fastsync.protocol import alive_key

__all__ = ["Heartbeat", "PeerWatch", "HEARTBEAT_PERIOD_S", "STALE_AFTER_S", "wait_key", "stop"]

#: How often a rank beats.
HEARTBEAT_PERIOD_S = 0.25
#: How long a counter may stand still before its rank counts as silent (many missed beats: a busy
#: host delays a beat, it does not stop them).
STALE_AFTER_S = 2.0
#: Bound on one sampling request of a watcher (it runs on a daemon thread; a cut store only
#: delays the next sample).
_SAMPLE_TIMEOUT_S = 2.0


class Heartbeat:
    """Beat ``alive/{role}/{rank}`` on a daemon thread, on a connection of its own, until
    :meth:`stop`; the store sets the death notice if this process dies first."""

    def __init__(self, control: ControlPlane, role: str, rank: int, period_s: float = HEARTBEAT_PERIOD_S) -> None:
        self.key, self.period_s = alive_key(role, rank), period_s
        self.control = control.dedicated()
        self._own = self.control is not control
        self.token = os.urandom(8).hex()
        self._stop = threading.Event()
        self.errors, self.last_error = 0, ""
        self.control.set(f"{self.key}/token", self.token)
        addr = self.control.local_address()
        if addr:  # where this rank runs, as the store sees it: named when it goes silent
            self.control.set(f"{self.key}/addr", addr)
        self.control.on_close(f"{self.key}/gone", self.token.encode())
        self.control.add(self.key, 1)
        self._thread = threading.Thread(target=self._run, name=f"fastsync-heartbeat-{role}{rank}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            try:
                # no deadline of its own beyond the connection's: a beat that waits out a cut
                # link is sent when the link returns, on the same connection (a reconnect would
                # look like a death to the store)
                self.control.add(self.key, 1, timeout_s=3600.0)
            except Exception as e:  # a store hiccup: the next beat retries
                self.errors += 1
                self.last_error = f"{type(e).__name__}: {e}"

    def stop(self) -> None:
        """A clean stop: no death notice."""
        self._stop.set()
        self._thread.join(timeout=2 * self.period_s + 1.0)
        if self._own and not self._thread.is_alive():
            self.control.close(bye=True)


class PeerWatch:
    """Watch the heartbeats of ``peers`` (``[(role, rank), ...]``); :meth:`check` raises
    SyncError naming a peer that died. A daemon thread samples the store every ``sample_s`` (so
    what it knows is ready the moment a wait asks); :meth:`check` only reads what it saw."""

    def __init__(self, control: ControlPlane, peers: list[tuple[str, int]], *, who: str,
                 stale_s: float = STALE_AFTER_S, sample_s: float = HEARTBEAT_PERIOD_S) -> None:
        self.control, self.who, self.stale_s, self.sample_s = control, who, stale_s, sample_s
        self.peers = list(peers)
        self._seen: dict[tuple[str, int], tuple[int, float]] = {}
        self._dead: dict[tuple[str, int], float] = {}
        self._addrs: dict[tuple[str, int], str] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.errors, self.last_error = 0, ""
        self._unreachable_since: float | None = None
        self._thread: threading.Thread | None = None
        if self.peers:
            self._thread = threading.Thread(target=self._run, name=f"fastsync-peerwatch-{who}", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.sample_s):
            try:
                self.sample()
            except Exception:  # counted in sample(); sample again next period
                pass

    def sample(self) -> None:
        """Read every peer's counter and death notice once, noting when each counter last moved."""
        now = time.monotonic()
        try:
            for peer in self.peers:
                key = alive_key(*peer)
                count = self.control.add(key, 0, timeout_s=_SAMPLE_TIMEOUT_S)
                gone = self.control.try_get(f"{key}/gone", timeout_s=_SAMPLE_TIMEOUT_S) if count else None
                token = self.control.try_get(f"{key}/token", timeout_s=_SAMPLE_TIMEOUT_S) if gone else None
                with self._lock:
                    prev = self._seen.get(peer)
                    if prev is None or count != prev[0]:
                        self._seen[peer] = (count, now)
                    if gone is not None and gone == token:
                        self._dead.setdefault(peer, now)
                    else:
                        self._dead.pop(peer, None)
        except (StoreUnreachable, FastSyncError) as e:
            with self._lock:
                self.errors += 1
                self.last_error = f"{type(e).__name__}: {e}"
                if self._unreachable_since is None:
                    self._unreachable_since = now
            raise
        with self._lock:
            self._unreachable_since = None

    def dead(self) -> list[tuple[str, int]]:
        """Peers whose process died (the store saw its heartbeat connection drop)."""
        with self._lock:
            return sorted(self._dead)

    def silent(self) -> list[tuple[str, int, float]]:
        """``(role, rank, seconds since its last beat)`` of every live-looking peer whose
        heartbeat stood still for more than ``stale_s`` (hung, or cut off from the store)."""
        now = time.monotonic()
        with self._lock:
            return [(p[0], p[1], now - t) for p, (count, t) in self._seen.items()
                    if count > 0 and now - t > self.stale_s and p not in self._dead]

    def silent_note(self) -> str:
        """A clause for a deadline's message: who went silent, and whether this rank could reach
        the store at all ("" when everything looked fine)."""
        parts = [f"{role} rank {rank}{self._where(role, rank)}: no heartbeat for {s:.1f} s (its host is unreachable, "
                 "or it hung)" for role, rank, s in self.silent()]
        with self._lock:
            since = self._unreachable_since
            last = self.last_error
        if since is not None:
            parts.append(f"{self.who} could not reach the control store for the last "
                         f"{time.monotonic() - since:.1f} s ({last})")
        return "; ".join(parts)

    def _where(self, role: str, rank: int) -> str:
        """`` at ADDR`` for a peer whose heartbeat published its address (read once, bounded)."""
        peer = (role, rank)
        if peer not in self._addrs:
            try:
                got = self.control.try_get(f"{alive_key(role, rank)}/addr", timeout_s=0.5)
            except FastSyncError:
                return ""  # not known now; ask again next time
            self._addrs[peer] = got.decode(errors="replace") if got else ""
        return f" at {self._addrs[peer]}" if self._addrs[peer] else ""

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.sample_s + _SAMPLE_TIMEOUT_S + 1.0)

    def check(self, during: str = "", among: set[tuple[str, int]] | None = None) -> None:
        """SyncError naming every watched peer (of ``among``, when given: e.g. only the trainer
        ranks whose writes are still missing) whose process died."""
        gone = [p for p in self.dead() if among is None or p in among]
        if gone:  # confirm with a fresh read: a replacement process may have started since the last sample
            try:
                self.sample()
            except FastSyncError:
                pass  # cannot confirm: the death was seen, it stands
            gone = [p for p in self.dead() if among is None or p in among]
        if gone:
            names = ", ".join(f"{role} rank {rank}{self._where(role, rank)}" for role, rank in gone)
            raise SyncError(f"{self.who}: {names} died{' ' + during if during else ''}: its process ended "
                            f"(its heartbeat connection to the control store closed)")


def stop(heartbeat: Heartbeat | None, watch: PeerWatch | None) -> None:
    """Stop a rank's heartbeat and its watch on its peers (either may be absent): what the
    sender's and the receiver's ``close`` do before closing their transport."""
    if heartbeat is not None:
        heartbeat.stop()
    if watch is not None:
        watch.stop()


def wait_key(control: ControlPlane, key: str, deadline: float, what: str, watch: PeerWatch | None) -> bytes:
    """Wait for ``key`` until ``deadline`` (``time.monotonic()``), giving up as soon as ``watch``
    names a dead peer; an unreachable store counts as "not yet". The deadline's SyncError names
    ``what``, the key, and any silent peer or unreachable store, and carries the key as
    ``deadline_key`` (only out of time, no peer named dead: ``WeightSync.sync`` then prefers an
    engine handle's own reason)."""
    last: StoreUnreachable | None = None
    while True:
        left = deadline - time.monotonic()
        try:
            got = control.try_get(key, timeout_s=max(min(left, 2.0), 0.05))
            last = None
        except StoreUnreachable as e:
            got, last = None, e
        if got is not None:
            return got
        if watch is not None:
            watch.check(f"while waiting for {what}")
        if deadline - time.monotonic() <= 0:
            note = watch.silent_note() if watch is not None else ""
            if last is not None:
                note = (note + "; " if note else "") + f"the control store did not answer: {last}"
            err = SyncError(f"control plane: {what} did not publish {key!r} by the deadline"
                            + (f" ({note})" if note else ""))
            err.deadline_key = key
            raise err
        time.sleep(min(0.002, max(left, 0.0)))
