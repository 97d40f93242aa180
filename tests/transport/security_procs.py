"""Processes of the security tests: a real NIXL receiver and sender of one job, and a foreign
process that knows the store's port but not the job secret. Run as
``python security_procs.py ROLE PORT [ARGS_JSON]``; each prints one JSON line as its result.

The job's processes take their secret from ``$FASTSYNC_JOB_SECRET``; the test starts the
attacker with that variable removed.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time

SIZE_BYTES = 3_000_003  # awkward on purpose
TIMEOUT_S = 60.0
#: where the store listens: loopback, or the store host's address on a host rig (tests/net)
STORE_HOST = os.environ.get("FASTSYNC_STORE_HOST", "127.0.0.1")


def _model():
    from fastsync.bench.model import build_bench_model

    return build_bench_model(trainers=1, rollouts=1, size_bytes=SIZE_BYTES)


def _listeners() -> list[str]:
    import psutil

    return sorted(f"{c.laddr.ip}:{c.laddr.port}" for c in psutil.Process().net_connections(kind="inet")
                  if c.status == psutil.CONN_LISTEN)


def receiver(port: int) -> None:
    """Serve versions the test opens (``t/open/{v}``) until ``t/stop``; report each outcome."""
    import torch

    from fastsync.bench.model import reference_tensors
    from fastsync.control import TCPStoreControl
    from fastsync.errors import SyncError
    from fastsync.sync.receiver import WeightReceiver
    from fastsync.executor.staging import Landing, as_bytes

    control = TCPStoreControl.client(port, host=STORE_HOST, timeout_s=TIMEOUT_S)
    model = _model()
    tensors = {n: torch.zeros(t.shape, dtype=getattr(torch, t.dtype)) for n, t in model.engine.tensors[0].items()}
    rx = WeightReceiver(rank=0, plan=model.plan, tensors=tensors, control=control, transport="nixl",
                        landing=Landing(tensors, mode="inplace", backup=True), timeout_s=TIMEOUT_S)
    rx.setup()
    control.set("t/recv/listeners", json.dumps(_listeners()))

    def differ() -> list[str]:
        """The live tensors that do not hold ``rx.version`` exactly."""
        want = reference_tensors(model, 0, rx.version) if rx.version else None
        return [n for n, t in tensors.items()
                if not ((not t.any()) if want is None else torch.equal(as_bytes(t), as_bytes(want[n].contiguous())))]

    def exact() -> bool:
        return not differ()

    v = 1
    checked: set[bytes] = set()
    while True:
        while (raw := control.try_get(f"t/open/{v}")) is None:
            if control.try_get("t/stop") is not None:
                rx.close()
                return
            # between versions, "TAG:SECONDS": progress UCX for up to SECONDS (until t/check/TAG/done),
            # then report whether the live tensors still hold rx.version. UCX over TCP applies a
            # one-sided write (and even sets up the writer's connection) only while the target
            # progresses; this does what NIXL's progress thread does all the time. No version is
            # open: nothing of the job is in flight.
            check = control.try_get("t/check")
            if check is not None and check not in checked:
                checked.add(check)
                tag, _, seconds = check.decode().partition(":")
                t_end, ask = time.monotonic() + float(seconds or 0), 0.0
                while (now := time.monotonic()) < t_end:
                    rx.transport.agent.get_new_notifs()
                    if now - ask > 0.1:
                        ask = now
                        if control.try_get(f"t/check/{tag}/done") is not None:
                            break
                    time.sleep(0.005)
                control.set(f"t/checked/{tag}", json.dumps({"version": rx.version, "differ": len(differ()),
                                                                     "of": len(tensors),
                                                                     "refused": dict(rx.transport.refused)}))
            time.sleep(0.01)
        window_s = float(raw)
        before = dict(rx.transport.refused)
        rx.begin(v)
        deadline = time.monotonic() + window_s
        last = 0.0
        while not rx.poll():  # until complete, the test closes the window, or the deadline
            now = time.monotonic()
            if now >= deadline:
                break
            if now - last > 0.05:
                last = now
                if control.try_get(f"t/close/{v}") is not None:
                    rx.poll()  # drain what arrived before the close
                    break
        try:
            rx.finish()
            error = None
        except SyncError as e:
            error = str(e)
        refused = {k: n - before.get(k, 0) for k, n in rx.transport.refused.items() if n - before.get(k, 0)}
        control.set(f"t/result/{v}", json.dumps({"version": rx.version, "error": error, "exact": exact(),
                                                 "refused": refused}))
        v += 1


def sender(port: int) -> None:
    """Write the versions the test asks for (``t/send/{v}``) until ``t/stop``."""
    from fastsync.bench.model import trainer_buffers
    from fastsync.control import TCPStoreControl
    from fastsync.sync.sender import WeightSender

    control = TCPStoreControl.client(port, host=STORE_HOST, timeout_s=TIMEOUT_S)
    model = _model()
    flat, views, _ = trainer_buffers(model, 0)
    tx = WeightSender(rank=0, plan=model.plan, sources=views, shards=model.trainer, control=control,
                      transport="nixl", timeout_s=TIMEOUT_S)
    tx.setup()
    control.set("t/send/listeners", json.dumps(_listeners()))
    sign_version = 0
    while control.try_get("t/stop") is None:
        raw = control.try_get("t/send/next")
        if raw is None or int(raw) <= tx.versions.attempted:
            time.sleep(0.01)
            continue
        v = int(raw)
        if (v - sign_version) % 2:  # the bench's values for version v (reference_tensors)
            flat.neg_()
        sign_version = v
        try:
            tx.sync(v)
            control.set(f"t/sent/{v}", b"ok")
        except Exception as e:  # reported to the test
            control.set(f"t/sent/{v}", f"err:{type(e).__name__}: {e}")
    tx.close()


def _state(agent, h) -> str:
    try:
        return agent.check_xfer_state(h)
    except Exception:  # noqa: BLE001 - NIXL raises for a failed transfer
        return "ERR"


def _write_with_metadata(agent, remote: str, meta: bytes, buf) -> dict:
    """One-sided WRITEs with nothing but a receiver's agent metadata: the metadata lists the
    registered regions (address, length, rkey), so every 8-byte value in it that looks like a
    user-space address is tried as a region start; NIXL refuses (on the writer's side) any that is
    not inside a region the metadata lists, and posts the rest, 64 bytes each, no notification.
    Whether they landed is for the receiver to tell (the test asks it); here: how many candidates
    were refused, how many posted, and the writer's own view of them after a few seconds (over
    TCP the writer hears of completion only once the target's UCX progresses)."""
    import struct

    import numpy as np

    words = (struct.unpack_from("<Q", meta, i)[0] for i in range(len(meta) - 7))
    cands = sorted({v for v in words if 0x10000 <= v < 0x800000000000 and v % 8 == 0})
    local = agent.get_xfer_descs(np.array([(buf.data_ptr(), 64, 0)], dtype=np.uint64), "DRAM")
    got: dict = {"candidates": len(cands), "refused": 0, "posted": 0}
    handles = []
    for addr in cands:
        try:
            h = agent.initialize_xfer("WRITE", local, agent.get_xfer_descs(
                np.array([(addr, 64, 0)], dtype=np.uint64), "DRAM"), remote)
        except Exception:  # noqa: BLE001 - not a registered region of the receiver
            got["refused"] += 1
            continue
        try:
            state = agent.transfer(h)
        except Exception:  # noqa: BLE001 - e.g. the agent the metadata names is gone
            state = "ERR"
        got["posted"] += state in ("PROC", "DONE")
        handles.append(h)
    states: dict[str, int] = {}
    deadline = time.monotonic() + 3.0
    pending = list(handles)
    while pending and time.monotonic() < deadline:
        pending = [h for h in pending if _state(agent, h) not in ("DONE", "ERR")]
        time.sleep(0.01)
    for h in handles:
        st = _state(agent, h)
        states[st] = states.get(st, 0) + 1
    got["writer_states"] = states
    return got


def attacker(port: int, args: dict) -> None:
    """Knows the port (and, when the test leaks it, the receiver's agent metadata and the names
    and captured notifications of the job); never the secret."""
    from fastsync.control import TCPStoreControl
    from fastsync.errors import FastSyncError

    out: dict = {"has_secret": "FASTSYNC_JOB_SECRET" in os.environ}
    # 1. the store, with a guessed secret: refused at the handshake
    try:
        c = TCPStoreControl.client(port, host=STORE_HOST, timeout_s=5, secret=os.urandom(32).hex())
        out["store_read"] = repr(c.try_get(args.get("read_key", "nixl/recv/0/meta")))
    except FastSyncError as e:
        out["store_refused"] = str(e)
    # 2. the store, speaking raw bytes (torch TCPStore's GET of the metadata key, then our magic
    #    with a made-up proof): the connection is closed without a byte of data
    raw_got = []
    for payload in (b"\x02" + len(b"fs/nixl/recv/0/meta").to_bytes(8, "little") + b"fs/nixl/recv/0/meta",
                    b"FSC1" + os.urandom(32)):
        with socket.create_connection((STORE_HOST, port), timeout=10) as s:
            s.sendall(payload)
            data = b""
            try:
                if payload.startswith(b"FSC1"):
                    data = s.recv(64)  # the server's nonce and proof (reveals nothing)
                    s.sendall(os.urandom(32))  # a made-up client proof
                    data = b""
                while chunk := s.recv(4096):
                    data += chunk
            except OSError:
                pass
            raw_got.append(len(data))
    out["raw_bytes_received"] = raw_got
    # 3. NIXL: without the receiver's metadata there is no agent to write to
    os.environ["UCX_NET_DEVICES"] = os.environ.get("FASTSYNC_NET_DEVICES", "lo")
    import numpy as np
    import torch
    from nixl._api import nixl_agent, nixl_agent_config

    conf = nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
    mallory = nixl_agent("mallory", conf)
    buf = torch.full((4096,), 0x5A, dtype=torch.uint8)
    mallory.register_memory([(buf.data_ptr(), buf.numel(), 0, "")], "DRAM")
    try:
        mallory.add_remote_agent(args.get("guessed_meta", "not metadata").encode())
        out["add_guessed_agent"] = "accepted"
    except Exception as e:  # noqa: BLE001 - any refusal is the expected outcome
        out["add_guessed_agent"] = f"refused: {type(e).__name__}"
    try:
        local = mallory.get_xfer_descs(np.array([(buf.data_ptr(), 4096, 0)], dtype=np.uint64), "DRAM")
        remote = mallory.get_xfer_descs(np.array([(int(args.get("guessed_addr", 0x10000)), 4096, 0)],
                                                 dtype=np.uint64), "DRAM")
        h = mallory.initialize_xfer("WRITE", local, remote, args.get("receiver_agent", "fastsync-recv0"), b"fs|1|0|0|1")
        out["write"] = mallory.transfer(h)
    except Exception as e:  # noqa: BLE001
        out["write"] = f"refused: {type(e).__name__}"
    # 4. with leaked metadata: send the forged and replayed notifications, as the agents given
    if args.get("leaked_meta"):
        meta = bytes.fromhex(args["leaked_meta"])
        agents = {"mallory": mallory}
        for name, msg in args.get("notifs", []):
            if name not in agents:
                agents[name] = nixl_agent(name, conf)
            a = agents[name]
            remote_name = a.add_remote_agent(meta) if not getattr(a, "_fs_added", False) else a._fs_remote
            a._fs_added, a._fs_remote = True, remote_name
            a.send_notif(remote_name, msg.encode())
        t0 = time.monotonic()
        while time.monotonic() - t0 < 1.0:  # drive progress so the notifications leave
            for a in agents.values():
                a.get_new_notifs()
            time.sleep(0.005)
        out["notifs_sent"] = len(args.get("notifs", []))
        if args.get("write_live"):
            try:
                remote = mallory._fs_remote if getattr(mallory, "_fs_added", False) else mallory.add_remote_agent(meta)
            except Exception as e:  # noqa: BLE001 - e.g. the endpoint the metadata names is gone
                out["leaked_write"] = {"add_agent": f"refused: {type(e).__name__}", "posted": 0}
            else:
                out["leaked_write"] = {"add_agent": "accepted", **_write_with_metadata(mallory, remote, meta, buf)}
    # 5. every other port the test found listening in the job's hosts: garbage, then hang up
    scanned = {}
    for addr in args.get("scan", []):
        ip, _, p = addr.rpartition(":")
        try:
            with socket.create_connection((ip, int(p)), timeout=5) as s:
                s.sendall(os.urandom(256))
                s.settimeout(2)
                try:
                    scanned[addr] = len(s.recv(4096))
                except OSError:
                    scanned[addr] = 0
        except OSError as e:
            scanned[addr] = f"refused: {e}"
    out["scanned"] = scanned
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    role, port = sys.argv[1], int(sys.argv[2])
    extra = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    {"receiver": lambda: receiver(port), "sender": lambda: sender(port),
     "attacker": lambda: attacker(port, extra)}[role]()
