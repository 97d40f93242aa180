"""``fastsync reload-bench --hosts H --joiners K``: K engines joining at once, filled from H live
peers, against the same K engines fetching the checkpoint from a storage host.

Hosts (``fastsync.bench.netns_cluster``, one shaped NIC each): holders on ``0..H-1``, joining engines on
``H..H+K-1``, a storage host last, serving the checkpoint's files over HTTP (``http.server``, the
way a hub or object store serves them). Every engine is a real vLLM CPU engine in its own process
on its host (``_engine_main``: the engine, and the engine-core process vLLM starts, live in the
host's namespace; the parent drives it through a pipe). The control store listens on the storage
host's address; the coordinator (``PeerReload``) runs in the parent.

Per round, all K joining engines at once, wall time from the first request to the last engine
filled: ``peer`` (each joiner asks ``PeerReload`` for the version from holder ``j % H``, which
writes it with NIXL over the NICs; a holder serves one joiner at a time) and ``checkpoint`` (each joiner downloads every safetensors file from the
storage host, then loads it with vLLM's own loader and repacks). Verified: every joining engine's
tensors' SHA-256 equal a holder's. The holders are loaded from the local checkpoint first (set-up,
not timed). Engines run with ``enforce_eager``: on this CPU build there is no compile cache that a
peer could ship besides the weights (``time to ready`` is engine start + weights + first request).
"""

from __future__ import annotations

import os
import statistics
import shutil
import subprocess
import sys
import threading
import time
import traceback
from typing import Any

from fastsync.errors import ConfigError, SyncError
from fastsync.layout.limits import check_bytes
from fastsync.procs import rank_context

__all__ = ["run_reload_bench_hosts"]


def _engine_main(conn: Any, ckpt: str, name: str) -> None:
    """One engine's process: a vLLM engine (dummy weights) and its reload handle, serving calls.
    The engine core and its one worker run inside this process (vLLM's in-process mode: no
    engine-core or worker process), about 0.9 GB each instead of 2.2 GB in three processes, so
    ten engines fit this machine beside other work."""
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # co-located engines: no shared pinning
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.dup2(2, 1)  # libraries log to stdout (NIXL, vLLM's engine core): the parent's stdout carries the report
    try:
        from vllm import LLM

        from fastsync.bench.reload import engine_kwargs, first_request_s
        from fastsync.engines.vllm.reload_host import VllmReloadEngine

        t0 = time.perf_counter()
        eng = VllmReloadEngine(LLM(**engine_kwargs(ckpt, "dummy"), distributed_executor_backend="uni"), name=name)
        eng.describe()
        conn.send(("ready", time.perf_counter() - t0))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        return
    while True:
        method, args = conn.recv()
        if method == "stop":
            break
        try:
            if method == "fetch_and_load":  # the checkpoint path: download over the NIC, then vLLM's loader
                url, files, version = args
                t0 = time.perf_counter()
                local = _download(url, files)
                t1 = time.perf_counter()
                try:
                    eng.load_checkpoint(local, version)
                finally:  # the download is this engine's own copy: remove it (it left a folder per run)
                    shutil.rmtree(local, ignore_errors=True)
                got = {"download_s": t1 - t0, "load_s": time.perf_counter() - t1}
            elif method == "first_request":
                got = first_request_s(eng)
            else:
                got = getattr(eng, method)(*args)
            conn.send(("ok", got))
        except BaseException as e:  # noqa: BLE001
            conn.send(("error", f"{type(e).__name__}: {e}"))
    try:
        eng.llm.llm_engine.engine_core.shutdown()
    except Exception:  # noqa: BLE001
        pass


def _download(url: str, files: list[str]) -> str:
    import tempfile
    import urllib.request

    out = tempfile.mkdtemp(prefix="fsreload-ckpt-")
    for f in files:
        with urllib.request.urlopen(f"{url}/{f}", timeout=600) as r, open(os.path.join(out, f), "wb") as w:
            while chunk := r.read(1 << 20):
                w.write(chunk)
    return out


class _Engine:
    """The parent's handle of one engine process (what ``PeerReload`` calls), one call at a time."""

    def __init__(self, rig: Any, host: int, ckpt: str, name: str, ctx: Any) -> None:
        from fastsync.bench.netns import run_in_host

        self.name, self.host = name, host
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=run_in_host, args=(rig.hosts[host].ns, rig.env(host, {}), _engine_main, child,
                                                          ckpt, name), daemon=False, name=f"fastsync-{name}")
        self.proc.start()
        self._lock = threading.Lock()
        self.start_s = 0.0

    def wait_ready(self, timeout_s: float) -> None:
        if not self.conn.poll(timeout_s):
            raise SyncError(f"reload-bench: engine {self.name} did not start within {timeout_s:.0f} s")
        kind, got = self.conn.recv()
        if kind != "ready":
            raise SyncError(f"reload-bench: engine {self.name} failed to start: {got}")
        self.start_s = got

    def call(self, method: str, *args: Any, timeout_s: float = 900.0) -> Any:
        with self._lock:
            self.conn.send((method, args))
            if not self.conn.poll(timeout_s):
                raise SyncError(f"reload-bench: engine {self.name}: {method} did not answer within {timeout_s:.0f} s")
            kind, got = self.conn.recv()
        if kind != "ok":
            raise SyncError(f"engine {self.name}: {method}: {got}")
        return got

    # PeerReload's handle
    def reload_describe(self) -> list[dict]:
        return self.call("reload_describe")

    def reload_send(self, plan_json: str, options: dict) -> list[dict]:
        return self.call("reload_send", plan_json, options)

    def reload_receive(self, plan_json: str, options: dict) -> list[dict]:
        return self.call("reload_receive", plan_json, options)

    def load_checkpoint(self, model_dir: str, version: int = 0) -> list[dict]:
        return self.call("load_checkpoint", model_dir, version)

    def alive(self) -> bool:
        return self.proc.is_alive()

    def close(self) -> None:
        try:
            with self._lock:
                self.conn.send(("stop", ()))
        except (OSError, EOFError):
            pass
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()


def _all_at_once(fns: list[Any]) -> tuple[float, list[Any]]:
    """Run every callable at once on its own thread; wall seconds until the last ended, results."""
    out: list[Any] = [None] * len(fns)

    def run(i: int) -> None:
        try:
            out[i] = fns[i]()
        except BaseException as e:  # noqa: BLE001 - returned, the caller raises
            out[i] = e

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(fns))]
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    bad = [r for r in out if isinstance(r, BaseException)]
    if bad:
        raise SyncError(f"reload-bench: {len(bad)} of {len(fns)} joining engines failed: {bad[0]}") from bad[0]
    return wall, out


def run_reload_bench_hosts(model: str, *, holders: int, joiners: int, nic_gbps: float, repeats: int = 2,
                           workdir: str | None = None, timeout_s: float = 300.0, fanout: str = "off",
                           chunk_bytes: int = 1 << 20, queue_ms: float = 200.0) -> dict:
    """See the module docstring; returns the JSON report. ``fanout``: ``off``, one holder per
    joining engine (joiner j from holder j % H); ``auto``/``chain``/``direct``, all joining
    engines in one plan (``PeerReload.reload_group``) in write batches of ``chunk_bytes``."""
    from fastsync.bench.netns import rig_unavailable
    from fastsync.bench.netns_cluster import HostRig, check_shape
    from fastsync.bench.reload import checkpoint_dir, checkpoint_files
    from fastsync.control import TCPStoreControl
    from fastsync.reload.coordinator import PeerReload

    if holders < 1 or joiners < 1 or repeats < 1:
        raise ConfigError(f"reload-bench: --hosts (holders) {holders}, --joiners {joiners} and --repeats {repeats} "
                          "must be at least 1")
    if fanout not in ("off", "auto", "chain", "direct"):
        raise ConfigError(f"reload-bench: --fanout must be off, auto, chain or direct, got {fanout!r}")
    if fanout != "off":
        check_bytes("--chunk-mb (chunk_bytes)", chunk_bytes)
    check_shape(holders + joiners + 1, nic_gbps)
    why = rig_unavailable()
    if why is not None:
        raise ConfigError(f"--hosts: {why}")
    ckpt = checkpoint_dir(model, workdir)
    files = [os.path.basename(f) for f in checkpoint_files(ckpt)]
    nbytes = sum(os.path.getsize(os.path.join(ckpt, f)) for f in files)
    storage = holders + joiners
    report: dict[str, Any] = {"model": model, "checkpoint_bytes": nbytes, "holders": holders, "joiners": joiners,
                              "nic_gbps": nic_gbps, "fanout": fanout,
                              "engine": "vllm-cpu, tp=1, bf16, enforce_eager, in-process engine core"}
    if fanout != "off":
        report["chunk_bytes"] = chunk_bytes
    report["load_average_at_start"] = [round(x, 2) for x in os.getloadavg()]  # a shared machine: say how busy
    ctx = rank_context()
    engines: list[_Engine] = []
    report["nic_queue_ms"] = queue_ms
    with HostRig(holders + joiners + 1, nic_gbps, queue_ms=queue_ms) as rig:
        with rig.entered(storage):
            control = TCPStoreControl.server(port=0, host=rig.addr(storage), timeout_s=timeout_s)
        port = 8000
        http = rig.popen(storage, [sys.executable, "-m", "http.server", str(port), "--bind", rig.addr(storage),
                                   "--directory", ckpt], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://{rig.addr(storage)}:{port}"
        try:
            t0 = time.perf_counter()
            engines = [_Engine(rig, h, ckpt, f"holder{h}", ctx) for h in range(holders)]
            engines += [_Engine(rig, holders + j, ckpt, f"joiner{j}", ctx) for j in range(joiners)]
            for e in engines:
                e.wait_ready(timeout_s * 3)
            report["engines_started_s"] = time.perf_counter() - t0
            hs, js = engines[:holders], engines[holders:]
            for h in hs:
                h.call("load_checkpoint", ckpt, 1)
            want = hs[0].call("digest")[0]["tensors"]
            # a holder sends to one joining engine at a time: joiner j takes holder j % H, so the
            # holders work in parallel (all K asking every holder at once queued them one by one:
            # 4 joiners, 2 holders at 0.5 Gb/s took 8.9 s against 9.8 s from storage)
            coord = PeerReload(control, timeout_s=timeout_s, max_holders=1)
            peer, ckpt_runs, detail = [], [], []
            verified = True
            for _ in range(repeats):
                nic = [rig.nic_bytes(i)[0] for i in range(len(rig.hosts))]
                if fanout == "off":
                    wall, reps = _all_at_once([lambda i=i, j=j: coord.reload(j, [hs[i % holders]], 1)
                                               for i, j in enumerate(js)])
                    per_joiner = [r.weights_s for r in reps]
                    phases = {k: [round(r.attempts[-1]["workers"][0][k], 3) for r in reps]
                              for k in ("connect_s", "begin_s", "wait_s", "postprocess_s", "close_s")}
                else:  # one plan over every joining engine: holders feed chain roots, joiners relay
                    wall, (rep,) = _all_at_once([lambda: coord.reload_group(js, hs, 1, fanout=fanout,
                                                                            max_transfer_bytes=chunk_bytes)])
                    reps = [rep]
                    workers = rep.attempts[-1].get("workers_of", {})
                    per_joiner = [w[0]["total_s"] for w in workers.values()]
                    report["chains"] = rep.fanout
                    phases = {k: [round(w[0][k], 3) for w in workers.values()]
                              for k in ("connect_s", "begin_s", "wait_s", "postprocess_s", "close_s")}
                    # from its begin until its own bytes were in (a relaying engine then still forwards)
                    phases["landed_s"] = [None if w[0].get("landed_s") is None else round(w[0]["landed_s"], 3)
                                          for w in workers.values()]
                sent = [rig.nic_bytes(i)[0] - n for i, n in enumerate(nic)]
                peer.append(wall)
                verified &= all(r.source == "peer" for r in reps)
                verified &= all(j.call("digest")[0]["tensors"] == want for j in js)
                nic = [rig.nic_bytes(i)[0] for i in range(len(rig.hosts))]
                wall_c, got = _all_at_once([lambda j=j: j.call("fetch_and_load", url, files, 1) for j in js])
                sent_c = [rig.nic_bytes(i)[0] - n for i, n in enumerate(nic)]
                ckpt_runs.append(wall_c)
                verified &= all(j.call("digest")[0]["tensors"] == want for j in js)
                detail.append({"peer_s": wall, "checkpoint_s": wall_c,
                               "peer_per_joiner_s": per_joiner,
                               "peer_phases_per_joiner_s": phases,
                               "checkpoint_per_joiner": got,
                               "peer_nic_tx_bytes": {"holders": sum(sent[:holders]), "storage": sent[storage],
                                                     "joiners": sum(sent[holders:storage])},
                               "peer_nic_tx_bytes_per_host": sent,
                               "checkpoint_nic_tx_bytes": {"holders": sum(sent_c[:holders]),
                                                           "storage": sent_c[storage]}})
            first = js[0].call("first_request")
            peer_s, ckpt_s = statistics.median(peer), statistics.median(ckpt_runs)
            start_s = statistics.median(e.start_s for e in js)
            report.update({
                "weights_seconds": {"peer": peer_s, "checkpoint": ckpt_s, "peer_runs": peer,
                                    "checkpoint_runs": ckpt_runs},
                "speedup_weights": ckpt_s / peer_s,
                "ready_seconds": {"peer": start_s + peer_s + first, "checkpoint": start_s + ckpt_s + first,
                                  "engine_start_dummy": start_s, "first_request": first},
                "speedup_ready": (start_s + ckpt_s + first) / (start_s + peer_s + first),
                "rounds": detail,
                "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
                "verified": bool(verified),
                "verified_detail": "SHA-256 of every joining engine tensor vs a holder filled by vLLM's loader",
                "shipped_besides_weights": "nothing: enforce_eager on the CPU build keeps no compile cache",
            })
        finally:
            for e in engines:
                e.close()
            http.kill()
            control.close()
    return report
