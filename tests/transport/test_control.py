"""The TCPStore control plane: values, deadlines that name the key, barriers, loopback by default."""

from __future__ import annotations

import os
import threading
import time

import pytest

from fastsync.control import DEFAULT_HOST, TCPStoreControl
from fastsync.errors import ConfigError, SyncError


@pytest.fixture(scope="module")
def server() -> TCPStoreControl:
    return TCPStoreControl.server(port=0, timeout_s=10)


def test_set_get_across_clients(server: TCPStoreControl) -> None:
    assert server.host == DEFAULT_HOST == "127.0.0.1"
    client = TCPStoreControl.client(server.port, timeout_s=10)
    client.set("a/b", b"\x00\x01")
    assert server.get("a/b", timeout_s=1) == b"\x00\x01"
    assert server.try_get("nope") is None
    assert client.add("ctr", 2) == 2 and server.add("ctr", 3) == 5


def test_get_deadline_names_the_key(server: TCPStoreControl) -> None:
    t0 = time.monotonic()
    with pytest.raises(SyncError, match="engine rank 3.*recv/3/info"):
        server.get("recv/3/info", timeout_s=0.3, what="engine rank 3")
    assert time.monotonic() - t0 < 2


def test_prefixes_do_not_collide(server: TCPStoreControl) -> None:
    a, b = server.with_prefix("job-a"), server.with_prefix("job-b")
    a.set("k", "1")
    assert b.try_get("k") is None and a.get("k", 1) == b"1"


def test_barrier(server: TCPStoreControl) -> None:
    done: list[int] = []

    def run(i: int) -> None:
        TCPStoreControl.client(server.port).barrier("b1", 3, timeout_s=10)
        done.append(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    assert not done
    server.barrier("b1", 3, timeout_s=10)
    for t in threads:
        t.join(5)
    assert sorted(done) == [0, 1]
    with pytest.raises(SyncError, match="barrier 'b2'"):
        server.barrier("b2", 2, timeout_s=0.2)


def test_client_needs_a_port() -> None:
    with pytest.raises(ConfigError):
        TCPStoreControl.client(0)


def test_job_secret_sources_and_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    from fastsync.security import SECRET_ENV, job_secret

    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(ConfigError, match="no job secret.*FASTSYNC_JOB_SECRET"):
        job_secret()
    with pytest.raises(ConfigError, match="3 bytes; at least 16"):
        job_secret("abc")
    assert job_secret("ab" * 16) == bytes.fromhex("ab" * 16)  # hex
    made = job_secret(create=True)  # the store's process: a fresh one, exported for its children
    assert len(made) == 32 and job_secret() == made and os.environ[SECRET_ENV] == made.hex()


def test_store_connections_send_small_frames_at_once():
    """TCP_NODELAY on the client's socket: without it a new connection's first request sat ~40 ms
    behind the handshake proof (Nagle waiting on a delayed ACK), at every worker's connect."""
    import socket

    from fastsync.control import TCPStoreControl

    srv = TCPStoreControl.server(port=0)
    try:
        c = TCPStoreControl.client(srv.port, prefix="nd", secret=srv.secret.hex())
        assert c.backend.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
        c.set("k", b"v")
        assert srv.with_prefix("nd").get("k", 5) == b"v"
    finally:
        srv.close()


_STORE = """
import sys, time
from fastsync.control import TCPStoreControl
s = TCPStoreControl.server(port=0, secret=sys.argv[1])
s.set("k", b"v")
print(s.port, flush=True)
time.sleep(120)
"""


def _wait_stopped(pid: int, timeout_s: float = 10.0) -> None:
    """Until ``pid`` is stopped (state T): kill(SIGSTOP) returns before a process that is running
    on the other core has stopped, and in that window it can still answer (seen on a loaded
    2-core machine: a reply 0.2 ms after the kill)."""
    import psutil  # a vLLM dependency, as the engine handles use it for a process's state

    deadline = time.monotonic() + timeout_s
    while psutil.Process(pid).status() != psutil.STATUS_STOPPED:
        assert time.monotonic() < deadline, f"process {pid} did not stop within {timeout_s} s of SIGSTOP"
        time.sleep(0.001)


def test_a_store_that_stops_answering_is_a_named_error_within_the_call_deadline_then_reconnects() -> None:
    """A partitioned store (here: its process stopped) never hangs a caller past its deadline:
    the request raises StoreUnreachable naming store and key, and once the store answers again the
    next request reconnects. A wait counts the silence as "not yet" until its own deadline."""
    import signal
    import subprocess
    import sys

    from fastsync.control import StoreUnreachable

    secret = os.urandom(32).hex()
    p = subprocess.Popen([sys.executable, "-c", _STORE, secret], stdout=subprocess.PIPE, text=True)
    try:
        port = int(p.stdout.readline())
        c = TCPStoreControl.client(port, secret=secret, timeout_s=30)
        assert c.try_get("k", timeout_s=2) == b"v"
        os.kill(p.pid, signal.SIGSTOP)
        _wait_stopped(p.pid)
        t0 = time.monotonic()
        with pytest.raises(StoreUnreachable, match=rf"no answer from the store at 127.0.0.1:{port} \(request for "
                                                   r"key 'fs/k'\) within 0.5 s"):
            c.try_get("k", timeout_s=0.5)
        assert time.monotonic() - t0 < 1.5
        t0 = time.monotonic()
        with pytest.raises(SyncError, match=r"did not publish 'k' within 0.8 s; the store was unreachable"):
            c.get("k", timeout_s=0.8)
        assert time.monotonic() - t0 < 2.5
        os.kill(p.pid, signal.SIGCONT)
        assert c.try_get("k", timeout_s=5) == b"v" and c.backend.reconnects >= 1
    finally:
        p.kill()
        p.wait(10)


def test_a_handshake_the_store_cuts_is_tried_again_within_the_deadline() -> None:
    """A store over its pending-handshake limit closes a new connection unread (on a loaded host
    it can also time a slow client's handshake out): the client connects again until its
    deadline instead of failing the rank; with the store still cutting at the deadline, the error
    names the store and the cut, not the job secret (a wrong secret fails the client's own check
    of the store's proof)."""
    from fastsync.store.kv import HandshakeError, StoreClient

    srv = TCPStoreControl.server(port=0, timeout_s=10)
    store = srv._server
    gate = threading.BoundedSemaphore(1)
    store._pending = gate
    assert gate.acquire(blocking=False)  # every handshake slot taken: new connections are cut
    try:
        with pytest.raises(HandshakeError, match=rf"store at 127.0.0.1:{srv.port} cut the handshake and did not take "
                                                 r"this client again within the deadline"):
            StoreClient(srv.secret, "127.0.0.1", srv.port, timeout_s=0.6)
        cut = store.refused
        assert cut >= 2  # tried more than once
        threading.Timer(0.4, gate.release).start()  # a slot frees while the client tries again
        c = StoreClient(srv.secret, "127.0.0.1", srv.port, timeout_s=10)
        assert store.refused > cut
        status, _ = c.request(b"S", "k", b"v")
        assert status == b"\x00" and store.state.data["k"] == b"v"
        c.close()
    finally:
        srv.close()
