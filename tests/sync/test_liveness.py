"""Heartbeats through a real TCPStore: a stopped rank is named within the stale time, a peer
that never started is not judged, and a replacement process that beats again counts as alive."""

from __future__ import annotations

import time

import pytest

from fastsync.control import TCPStoreControl
from fastsync.errors import SyncError
from fastsync.sync.liveness import Heartbeat, PeerWatch


def test_stopped_heartbeat_is_named_and_a_replacement_revives(free_port):
    store = TCPStoreControl.server(port=0)
    hb = Heartbeat(store, "engine", 1, period_s=0.05)
    watch = PeerWatch(store, [("engine", 1), ("trainer", 7)], who="trainer rank 0", stale_s=0.5, sample_s=0.05)
    try:
        time.sleep(0.3)
        watch.check()  # alive; trainer 7 never beat: not judged
        hb.stop()  # the process "dies"
        t0 = time.monotonic()
        with pytest.raises(SyncError, match=r"trainer rank 0: engine rank 1 \(no heartbeat for .*\) is dead or hung"):
            while time.monotonic() - t0 < 5:
                watch.check("during version 3")
                time.sleep(0.02)
        assert time.monotonic() - t0 < 1.5
        hb = Heartbeat(store, "engine", 1, period_s=0.05)  # a replacement process beats the same key
        watch.check()  # confirmed with a fresh read: no false alarm
        assert not watch.dead()
    finally:
        hb.stop()
        watch.stop()
