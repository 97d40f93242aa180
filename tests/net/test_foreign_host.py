"""A foreign host on the job's network (issue 20, part 7): three rig hosts on one bridge. The job
runs on two of them (the control store and the NIXL sender on host 0, the NIXL receiver on host 1);
host 2 is not part of the job and never gets the job secret. From host 2 the attacker scans every
port the job listens on, tries the store with raw bytes and with a made-up secret, tries to add the
receiver's NIXL agent and write without its metadata, and (the worst case: the receiver's agent
metadata, the sender's agent name and version 1's notifications all leaked) sends forged, replayed
and re-labelled notifications. Traffic flows only between the namespaces this test made.

What fastsync enforces, and this test checks: the store answers nobody without the secret (refused
at the handshake, counted); no notification without a MAC under the job secret, from the agent the
sender announced, for the open version, with the announced batch count, ever completes a version
(each refused and counted by reason); every listener binds its host's own address only.

What it cannot enforce, and this test shows as it is: UCX over TCP does not authenticate one-sided
WRITEs. A receiver's agent metadata lists its registered regions (address, length, rkey), so
whoever holds it can write into them, with no notification, so with nothing for fastsync to see or
count. With the in-place landing the live engine tensors are registered: here every one of them is
overwritten from the foreign host between versions, the receiver still reports version 1 and its
refusal counters do not move; the next complete version overwrites the forged bytes. Over TCP such
a write is applied only while the target's UCX progresses (the test has the receiver progress, as
NIXL's progress thread would; fastsync's receivers otherwise progress only while a version is open,
so a write posted between versions would land at the next version's first poll: not tested here). A
receiver renews its endpoint after an incomplete version: the metadata leaked before then no longer
reaches it (checked: the same attack afterwards changes nothing). NIXL refuses, on the writer's
side, addresses outside the regions the metadata lists: a check in the attacker's own library, not
a boundary. The protection is that the metadata travels only over the authenticated, encrypted
store (and the network the job runs on).
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
from fastsync.security import SECRET_ENV, derive_key, mac
from fastsync.transport import availability

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not availability("nixl")[0], reason="NIXL is not importable here")]

PROCS = Path(__file__).resolve().parents[1] / "transport" / "security_procs.py"
ROOT = Path(__file__).resolve().parents[2]
JOB, RECV, FOREIGN = 0, 1, 2


def _listeners(rig, host: int) -> list[str]:
    """Every listening TCP socket in ``host``'s namespace (/proc/net/tcp as seen from inside)."""
    out = rig.run(host, ["cat", "/proc/net/tcp"]).stdout.splitlines()[1:]
    found = []
    for line in out:
        parts = line.split()
        if parts[3] != "0A":  # LISTEN
            continue
        hexip, hexport = parts[1].split(":")
        ip = ".".join(str(int(hexip[i:i + 2], 16)) for i in (6, 4, 2, 0))
        found.append(f"{ip}:{int(hexport, 16)}")
    return sorted(found)


class HostJob:
    def __init__(self, rig) -> None:
        self.rig = rig
        self.secret = os.urandom(32).hex()
        with rig.entered(JOB):
            self.store = TCPStoreControl.server(port=0, host=rig.addr(JOB), timeout_s=60, secret=self.secret)
        self.procs: dict[str, subprocess.Popen] = {}

    def env(self, secret: bool) -> dict:
        env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
        env.update({"PYTHONPATH": os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]), "NIXL_LOG_LEVEL": "WARN",
                    "OMP_NUM_THREADS": "1", "FASTSYNC_STORE_HOST": self.rig.addr(JOB)})
        if secret:
            env[SECRET_ENV] = self.secret
        return env

    def start(self, role: str, host: int) -> None:
        self.procs[role] = self.rig.popen(host, [sys.executable, str(PROCS), role, str(self.store.port)],
                                          env=self.env(True), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

    def wait_key(self, key: str, timeout_s: float = 120) -> bytes:
        deadline = time.monotonic() + timeout_s
        while (got := self.store.try_get(key)) is None:
            dead = {r: p.returncode for r, p in self.procs.items() if p.poll() is not None}
            assert not dead, f"job process(es) exited {dead}: " + " ".join(
                self.procs[r].stdout.read().decode(errors="replace")[-2000:] for r in dead)
            assert time.monotonic() < deadline, f"{key!r} not published within {timeout_s} s"
            time.sleep(0.02)
        return got

    def open(self, v: int, window_s: float) -> None:
        self.store.set(f"t/open/{v}", str(window_s))
        self.wait_key(f"recv/0/begun/{v}")

    def result(self, v: int) -> dict:
        return json.loads(self.wait_key(f"t/result/{v}"))

    def sync(self, v: int) -> dict:
        self.open(v, 60)
        self.store.set("t/send/next", str(v))
        assert self.wait_key(f"t/sent/{v}") == b"ok"
        return self.result(v)

    def check(self, tag: str, progress_s: float = 0.0, then=None) -> tuple[dict, object]:
        """Between versions: the receiver progresses its UCX while ``then()`` runs here (at most
        ``progress_s``), then reports its version, how many of its live tensors do not hold it
        exactly (``differ`` of ``of``) and its refusal counters so far. Returns (report, then's
        result)."""
        self.store.set("t/check", f"{tag}:{progress_s}")
        try:
            got = then() if then is not None else None
        finally:
            self.store.set(f"t/check/{tag}/done", b"1")
        return json.loads(self.wait_key(f"t/checked/{tag}", timeout_s=progress_s + 120)), got

    def attack(self, args: dict) -> dict:
        got = self.rig.run(FOREIGN, [sys.executable, str(PROCS), "attacker", str(self.store.port), json.dumps(args)],
                           env=self.env(False), timeout_s=180)
        lines = [ln for ln in got.stdout.splitlines() if ln.startswith("RESULT ")]
        assert got.returncode == 0 and lines, f"attacker failed ({got.returncode}): {got.stdout[-2000:]}{got.stderr[-2000:]}"
        return json.loads(lines[-1][7:])

    def close(self) -> None:
        self.store.set("t/stop", b"1")
        for p in self.procs.values():
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        self.store.close()


def test_a_host_outside_the_job_is_refused_everywhere_and_counted(host_rig) -> None:
    rig = host_rig(3, nic_gbps=1.0)
    job = HostJob(rig)
    try:
        job.start("receiver", RECV)
        job.start("sender", JOB)
        job.wait_key("t/recv/listeners")
        job.wait_key("t/send/listeners")
        assert job.sync(1)["version"] == 1
        # every listener of the job, in both of its hosts, is bound to that host's own address
        ports = {h: _listeners(rig, h) for h in (JOB, RECV)}
        for h, found in ports.items():
            assert found, f"host {h} listens nowhere"
            for addr in found:
                assert addr.rsplit(":", 1)[0] == rig.addr(h), f"host {h} listens on {addr}"
        assert f"{rig.addr(JOB)}:{job.store.port}" in ports[JOB]
        scan = [a for h in (JOB, RECV) for a in ports[h] if a != f"{rig.addr(JOB)}:{job.store.port}"]

        meta = job.store.get("nixl/recv/0/meta", 5)
        info = json.loads(job.store.get("nixl/send/0/to/0", 5))
        agent, n = info["agent"], info["posts"]
        key = derive_key(bytes.fromhex(job.secret), "nixl notifications")

        def signed(v: int, k: int, count: int) -> str:
            return f"fs|{v}|0|{k}|{count}|" + mac(key, "fs", agent, "0", str(v), "0", str(k), str(count)).hex()

        captured = [signed(1, k, n) for k in range(n)]
        notifs = ([("mallory", f"fs|2|0|{k}|{n}|{os.urandom(16).hex()}") for k in range(n)]
                  + [(agent, f"fs|2|0|{k}|{n}|{os.urandom(16).hex()}") for k in range(n)]
                  + [(agent, m) for m in captured]
                  + [(agent, m.replace("fs|1|", "fs|2|", 1)) for m in captured]
                  + [(agent, "fs|2|0|0|1")])
        refused_before = job.store._server.refused
        job.open(2, window_s=120)
        got = job.attack({"leaked_meta": meta.hex(), "notifs": notifs, "scan": scan,
                          "receiver_agent": "fastsync-recv0"})
        time.sleep(1.0)
        job.store.set("t/close/2", b"1")
        r2 = job.result(2)
        # the store: a made-up secret and two raw connections refused, not a byte of data back
        assert got["has_secret"] is False and "store_read" not in got and "secret" in got["store_refused"]
        assert got["raw_bytes_received"] == [0, 0]
        deadline = time.monotonic() + 10
        while job.store._server.refused < refused_before + 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert job.store._server.refused >= refused_before + 3
        # NIXL without metadata: no agent, no write
        assert got["add_guessed_agent"].startswith("refused") and got["write"].startswith("refused")
        # UCX's listeners took the garbage and answered nothing
        assert set(got["scanned"]) == set(scan) and all(v == 0 or str(v).startswith("refused")
                                                        for v in got["scanned"].values()), got["scanned"]
        # every forged, replayed or re-labelled notification refused and counted; version 1 kept intact
        assert r2["version"] == 1 and r2["exact"] and "incomplete" in r2["error"], r2
        refused = r2["refused"]
        assert refused.get("not trainer rank 0's agent") == n and refused.get("bad MAC") == 2 * n, refused
        assert refused.get("old version (late or replayed)") == n and refused.get("malformed") == 1, refused
        assert sum(refused.values()) == len(notifs), refused
        # what UCX does not protect: with the leaked metadata alone, a WRITE between versions lands
        # in the receiver's live tensors; no notification, so nothing refused, nothing counted
        before, _ = job.check("before-leaked-write")
        assert before["version"] == 1 and before["differ"] == 0, before
        leak = {"leaked_meta": meta.hex(), "write_live": True}
        after, got = job.check("leaked-write", 120.0, lambda: job.attack(leak))
        w = got["leaked_write"]
        # every region the metadata lists posted, every other word of it refused by NIXL
        assert w["add_agent"] == "accepted" and w["posted"] >= after["of"] and w["refused"] >= 1, w
        assert after["version"] == 1 and after["differ"] == after["of"], (after, w)  # every live tensor, no flip
        assert after["refused"] == before["refused"], (before, after)
        # and the job goes on across the hosts: the next complete version overwrites the forged bytes,
        # on a renewed endpoint (version 2 did not complete): the leaked metadata no longer names it
        r3 = job.sync(3)
        assert r3 == {"version": 3, "error": None, "exact": True, "refused": {}}, r3
        assert job.store.get("nixl/recv/0/meta", 5) != meta
        stale, got = job.check("stale-write", 120.0, lambda: job.attack(leak))
        assert stale["version"] == 3 and stale["differ"] == 0, (stale, got["leaked_write"])
        assert got["leaked_write"]["add_agent"].startswith("refused"), got["leaked_write"]  # its listener is gone
    finally:
        job.close()
