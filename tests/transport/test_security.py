"""The control plane and NIXL notifications against a foreign process (real processes, real NIXL,
loopback only): the attack of issue 9, reproduced, must fail at every step.

The job is the test process (it owns the store), one NIXL receiver and one NIXL sender process
(``security_procs.py``); the attacker is a process started without the job secret.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fastsync.control import TCPStoreControl
from fastsync.errors import ConfigError, SyncError
from fastsync.security import SECRET_ENV, derive_key, mac

pytest.importorskip("nixl._api")

PROCS = Path(__file__).with_name("security_procs.py")
ROOT = Path(__file__).resolve().parents[2]


def _env(secret: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.update({"NIXL_LOG_LEVEL": "WARN", "OMP_NUM_THREADS": "1"})
    if secret is not None:
        env[SECRET_ENV] = secret
    return env


class Job:
    """Store in this process, receiver and sender processes; everything killed on exit."""

    def __init__(self) -> None:
        self.secret = os.urandom(32).hex()
        self.store = TCPStoreControl.server(port=0, timeout_s=60, secret=self.secret)
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, role: str) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, str(PROCS), role, str(self.store.port)], env=_env(self.secret),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.procs[role] = p
        return p

    def wait_key(self, key: str, timeout_s: float = 90) -> bytes:
        deadline = time.monotonic() + timeout_s
        while (got := self.store.try_get(key)) is None:
            dead = {r: p.returncode for r, p in self.procs.items() if p.poll() is not None}
            if dead:
                out = {r: self.procs[r].stdout.read().decode(errors="replace")[-3000:] for r in dead}
                raise AssertionError(f"job process(es) exited {dead} while waiting for {key!r}: {out}")
            assert time.monotonic() < deadline, f"{key!r} not published within {timeout_s} s"
            time.sleep(0.02)
        return got

    def open(self, version: int, window_s: float) -> None:
        self.store.set(f"t/open/{version}", str(window_s))
        self.wait_key(f"recv/0/begun/{version}")

    def result(self, version: int) -> dict:
        return json.loads(self.wait_key(f"t/result/{version}"))

    def sync(self, version: int) -> dict:
        self.open(version, 60)
        self.store.set("t/send/next", str(version))
        assert self.wait_key(f"t/sent/{version}") == b"ok"
        return self.result(version)

    def close(self) -> None:
        self.store.set("t/stop", b"1")
        for p in self.procs.values():
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
        self.store.close()


def _attack(port: int, args: dict) -> dict:
    p = subprocess.run([sys.executable, str(PROCS), "attacker", str(port), json.dumps(args)], env=_env(None),
                       capture_output=True, timeout=120)
    out = p.stdout.decode(errors="replace")
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, f"attacker process failed ({p.returncode}): {out[-3000:]}{p.stderr[-3000:]!r}"
    return json.loads(lines[-1][7:])


def _assert_loopback(listeners: list[str], who: str) -> None:
    assert listeners, f"{who} listens nowhere (expected the UCX listener on loopback)"
    for addr in listeners:
        ip = addr.rsplit(":", 1)[0]
        assert ip in ("127.0.0.1", "::1"), f"{who} listens on {addr}: not loopback"


def _own_listeners() -> list[str]:
    import psutil

    return [f"{c.laddr.ip}:{c.laddr.port}" for c in psutil.Process().net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN]


@pytest.fixture
def job():
    j = Job()
    try:
        yield j
    finally:
        j.close()


@pytest.mark.slow
def test_foreign_process_knowing_the_port_cannot_read_write_or_flip(job: Job) -> None:
    job.start("receiver")
    _assert_loopback(json.loads(job.wait_key("t/recv/listeners")), "the NIXL receiver")
    _assert_loopback(_own_listeners(), "the control store's process")
    assert any(a.endswith(f":{job.store.port}") for a in _own_listeners())
    refused_before = job.store._server.refused

    job.open(1, window_s=120)  # a version is open: the moment the attacker flipped it
    got = _attack(job.store.port, {"receiver_agent": "fastsync-recv0"})
    job.store.set("t/close/1", b"1")
    assert got["has_secret"] is False
    assert "store_read" not in got and "secret" in got["store_refused"]  # read: refused at the handshake
    assert got["raw_bytes_received"] == [0, 0]  # raw requests: closed, not one byte of data back
    assert _refusals(job.store._server, refused_before + 3) >= refused_before + 3
    assert got["add_guessed_agent"].startswith("refused")  # no metadata, no remote agent
    assert got["write"].startswith("refused")  # and no write
    r1 = job.result(1)
    assert r1["version"] == 0 and r1["error"] and r1["exact"], r1  # not flipped, weights untouched
    # the store served the job all along, and the job still syncs: the refusals were the attacker's
    job.start("sender")
    _assert_loopback(json.loads(job.wait_key("t/send/listeners")), "the NIXL sender")
    r2 = job.sync(2)
    assert r2 == {"version": 2, "error": None, "exact": True, "refused": {}}, r2


@pytest.mark.slow
def test_forged_and_replayed_notifications_are_refused_and_counted(job: Job) -> None:
    job.start("receiver")
    job.start("sender")
    assert job.sync(1)["version"] == 1
    # the worst case: the receiver's agent metadata and the sender's agent name leaked, and the
    # attacker captured version 1's notifications; it still lacks the secret
    meta = job.store.get("nixl/recv/0/meta", 5)
    info = json.loads(job.store.get("nixl/send/0/to/0", 5))
    agent, n = info["agent"], info["posts"]
    key = derive_key(bytes.fromhex(job.secret), "nixl notifications")

    def signed(v: int, k: int, count: int) -> str:
        return f"fs|{v}|0|{k}|{count}|" + mac(key, "fs", agent, "0", str(v), "0", str(k), str(count)).hex()

    captured = [signed(1, k, n) for k in range(n)]
    notifs = (
        [("mallory", f"fs|2|0|{k}|{n}|{os.urandom(16).hex()}") for k in range(n)]  # wrong agent
        + [(agent, f"fs|2|0|{k}|{n}|{os.urandom(16).hex()}") for k in range(n)]  # sender's name, made-up MAC
        + [(agent, m) for m in captured]  # replay of version 1
        + [(agent, m.replace("fs|1|", "fs|2|", 1)) for m in captured]  # replay re-labelled as version 2
        + [(agent, "fs|2|0|0|1"), ("mallory", "fs|2|0|0|1")]  # the unsigned format
        + [(agent, signed(2, 0, n + 1))]  # signed by the job but a count the set-up never announced
        + [(agent, signed(2, 7, 1) if n != 1 else signed(2, 0, 2))]
    )
    job.open(2, window_s=120)
    got = _attack(job.store.port, {"leaked_meta": meta.hex(), "notifs": notifs})
    assert got["notifs_sent"] == len(notifs)
    time.sleep(1.0)  # let the receiver poll what arrived
    job.store.set("t/close/2", b"1")
    r2 = job.result(2)
    assert r2["version"] == 1 and r2["exact"] and "incomplete" in r2["error"], r2  # still version 1, intact
    refused = r2["refused"]
    assert refused.get("not trainer rank 0's agent") == n, refused
    assert refused.get("bad MAC") == 2 * n, refused
    assert refused.get("old version (late or replayed)") == n, refused
    assert refused.get("malformed") == 2, refused
    assert sum(v for k, v in refused.items() if k.startswith("batch ")) == 2, refused
    assert sum(refused.values()) == len(notifs)
    # the job's own next version goes through
    r3 = job.sync(3)
    assert r3 == {"version": 3, "error": None, "exact": True, "refused": {}}, r3


def _refusals(server, at_least: int, timeout_s: float = 10.0) -> int:
    """The store's refusal count once it reaches ``at_least`` (or the deadline passes). A client
    that sees the server's proof fail hangs up at once; the server counts the refusal when its own
    read of the proof ends, on its connection thread, a moment later."""
    deadline = time.monotonic() + timeout_s
    while server.refused < at_least and time.monotonic() < deadline:
        time.sleep(0.01)
    return server.refused


def test_store_refuses_clients_without_the_secret_and_keeps_serving() -> None:
    ctl = TCPStoreControl.server(port=0, timeout_s=10, secret="11" * 32)
    try:
        good = TCPStoreControl.client(ctl.port, timeout_s=10, secret="11" * 32)
        with pytest.raises(SyncError, match="refused|secret"):
            TCPStoreControl.client(ctl.port, timeout_s=10, secret="22" * 32)
        with pytest.raises(ConfigError, match="no job secret"):
            env = os.environ.pop(SECRET_ENV, None)
            try:
                TCPStoreControl.client(ctl.port, timeout_s=10)
            finally:
                if env is not None:
                    os.environ[SECRET_ENV] = env
        good.set("k", b"v")
        assert ctl.get("k", 1) == b"v"
        assert _refusals(ctl._server, 1) == 1
    finally:
        ctl.close()


def test_store_binds_only_the_host_it_is_given() -> None:
    ctl = TCPStoreControl.server(port=0, timeout_s=10, secret="33" * 32)
    try:
        mine = [a for a in _own_listeners() if a.endswith(f":{ctl.port}")]
        assert mine == [f"127.0.0.1:{ctl.port}"]
    finally:
        ctl.close()


@pytest.mark.slow
def test_kimi_k2_plan_over_8_mib_publishes_and_is_fetched() -> None:
    from fastsync.layout.spec import engine_layout_from_spec, trainer_layout_from_spec
    from fastsync.models import load_inventory
    from fastsync.plan.planner import build_plan
    from fastsync.plan.types import Plan

    inv = load_inventory("kimi-k2")
    trainer = trainer_layout_from_spec("fsdp:256", inv)
    engine = engine_layout_from_spec("vllm:tp8,dp4,ep,replicas4", inv, dtype_out="fp8")
    plan = build_plan(inv.params, trainer, engine, allow_unread={"lm_head.weight"} if inv.tied_embeddings else set())
    raw = plan.dumps().encode()
    assert len(raw) > 32 << 20  # about 64 MiB: eight times the old store's limit
    ctl = TCPStoreControl.server(port=0, timeout_s=60, secret="44" * 32)
    try:
        writer = TCPStoreControl.client(ctl.port, timeout_s=60, secret="44" * 32)
        reader = TCPStoreControl.client(ctl.port, timeout_s=60, secret="44" * 32)
        writer.set("ws/setup1/plan", raw)
        got = reader.get("ws/setup1/plan", 60)
        assert got == raw and Plan.loads(got.decode()).plan_hash == plan.plan_hash
    finally:
        ctl.close()


def test_over_limit_value_names_key_and_size_and_the_connection_survives() -> None:
    ctl = TCPStoreControl.server(port=0, timeout_s=10, secret="55" * 32, max_value_bytes=1 << 20)
    try:
        small = TCPStoreControl.client(ctl.port, timeout_s=10, secret="55" * 32, max_value_bytes=1 << 20)
        with pytest.raises(ConfigError, match=r"'fs/big'.*2097155 bytes.*limit of 1048576"):
            small.set("big", b"x" * (2 << 20 | 3))
        # a client allowing more meets the server's own limit: refused by the server, named
        big = TCPStoreControl.client(ctl.port, timeout_s=10, secret="55" * 32, max_value_bytes=8 << 20)
        with pytest.raises(ConfigError, match=r"'fs/big2'.*limit of 1048576"):
            big.set("big2", b"y" * (3 << 20))
        big.set("after", b"ok")  # the same connection keeps working
        assert small.get("after", 1) == b"ok" and ctl.try_get("big2") is None
    finally:
        ctl.close()


def test_a_replayed_or_tampered_frame_drops_the_connection_not_the_store() -> None:
    """Frames are AES-GCM under sequence-number nonces: re-sending a frame (replay) or flipping a
    bit fails authentication; the server drops that connection and serves the others."""
    from fastsync.errors import TransportError

    ctl = TCPStoreControl.server(port=0, timeout_s=10, secret="88" * 32)
    try:
        replayer = TCPStoreControl.client(ctl.port, timeout_s=10, secret="88" * 32)
        replayer.set("k", b"1")
        replayer.backend.ch._tx_seq -= 1  # the next frame reuses the last one's nonce: a replay
        with pytest.raises(TransportError, match="lost the store"):
            replayer.set("k", b"2")
        tamperer = TCPStoreControl.client(ctl.port, timeout_s=10, secret="88" * 32)
        real_send = tamperer.backend.sock.sendall
        tamperer.backend.sock = type("Flip", (), {"sendall": lambda self, b: real_send(b[:-1] + bytes([b[-1] ^ 1])),
                                                  "recv_into": tamperer.backend.sock.recv_into,
                                                  "settimeout": tamperer.backend.sock.settimeout,
                                                  "close": tamperer.backend.sock.close})()
        tamperer.backend.ch.sock = tamperer.backend.sock
        with pytest.raises(TransportError, match="lost the store"):
            tamperer.set("k", b"3")
        other = TCPStoreControl.client(ctl.port, timeout_s=10, secret="88" * 32)
        assert other.get("k", 1) == b"1"
    finally:
        ctl.close()
