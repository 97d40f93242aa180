"""Heartbeats through a real store, with real processes: a killed rank is named at once (the
store saw its heartbeat connection close), a stopped (hung) or cut-off rank is only reported as
silent and left to the deadline, a clean stop is no death, and a replacement revives."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from fastsync.control import TCPStoreControl
from fastsync.errors import SyncError
from fastsync.sync.liveness import Heartbeat, PeerWatch

_BEAT = """
import sys, time
from fastsync.control import TCPStoreControl
from fastsync.sync.liveness import Heartbeat
c = TCPStoreControl.client(int(sys.argv[1]), secret=sys.argv[2])
hb = Heartbeat(c, "engine", 1, period_s=0.05)
print("beating", flush=True)
if sys.argv[3] == "stop":
    time.sleep(0.3)
    hb.stop()
    print("stopped", flush=True)
time.sleep(60)
"""


def _beater(store: TCPStoreControl, mode: str = "run") -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", _BEAT, str(store.port), store.secret.hex(), mode],
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "beating"
    return p


def _watch(store: TCPStoreControl) -> PeerWatch:
    return PeerWatch(store, [("engine", 1), ("trainer", 7)], who="trainer rank 0", stale_s=0.5, sample_s=0.05)


def _until(pred, timeout_s: float = 5.0) -> float:
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < timeout_s, "condition not reached"
        time.sleep(0.02)
    return time.monotonic() - t0


def test_killed_rank_is_named_at_once_and_a_replacement_revives() -> None:
    store = TCPStoreControl.server(port=0)
    watch = _watch(store)
    p = _beater(store)
    try:
        time.sleep(0.3)
        watch.check()  # alive; trainer 7 never beat: not judged
        p.kill()
        p.wait(10)
        took = _until(lambda: watch.dead() == [("engine", 1)])
        assert took < 1.5  # a round trip and a sample, not the stale time
        with pytest.raises(SyncError, match=r"trainer rank 0: engine rank 1 at 127.0.0.1 died during version 3"):
            watch.check("during version 3")
        p = _beater(store)  # a replacement process: new token, alive again
        _until(lambda: not watch.dead())
        watch.check()
    finally:
        p.kill()
        watch.stop()
        store.close()


def test_hung_rank_is_silent_not_dead_and_a_clean_stop_is_no_death() -> None:
    store = TCPStoreControl.server(port=0)
    watch = _watch(store)
    p = _beater(store)
    try:
        time.sleep(0.3)
        os.kill(p.pid, signal.SIGSTOP)  # hung, or its host cut off: looks the same from here
        _until(lambda: [s[:2] for s in watch.silent()] == [("engine", 1)])
        watch.check("during version 2")  # not a reason to fail before the deadline
        assert watch.dead() == []
        assert "engine rank 1 at 127.0.0.1: no heartbeat for" in watch.silent_note()
        os.kill(p.pid, signal.SIGCONT)
        _until(lambda: not watch.silent())
    finally:
        p.kill()
        p.wait(10)
    p = _beater(store, "stop")
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "stopped"
        p.kill()  # the process ends after a clean stop: its heartbeat said goodbye first
        p.wait(10)
        time.sleep(0.5)
        assert watch.dead() == [], "a clean stop left a death notice"
    finally:
        watch.stop()
        store.close()


def test_watcher_that_cannot_reach_the_store_judges_nobody_and_says_so() -> None:
    store = TCPStoreControl.server(port=0)
    hb = Heartbeat(store, "engine", 1, period_s=0.05)
    client = TCPStoreControl.client(store.port, secret=store.secret)
    watch = PeerWatch(client, [("engine", 1)], who="engine rank 0", stale_s=0.5, sample_s=0.05)
    try:
        time.sleep(0.3)
        store.close()  # the store goes away under the watcher
        _until(lambda: "could not reach the control store" in watch.silent_note())
        watch.check()
        assert watch.dead() == []
    finally:
        hb.stop()
        watch.stop()
