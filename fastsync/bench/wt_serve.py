"""A real ``vllm serve`` with fastsync's weight-transfer backend, and what a host sees of it.

:class:`VllmServe` starts ``vllm serve`` (vLLM's own OpenAI server module, on CPU) with
``--weight-transfer-config '{"backend": "fastsync"}'``, ``VLLM_SERVER_DEV_MODE=1`` (the
weight-transfer and ``/pause`` routes) and ``--enable-scale-out`` (``/inference/v1/generate``,
token ids in and out, whose choices carry vLLM's ``weight_versions`` spans), waits for
``/health`` with a deadline, and stops the whole process group. :func:`generate` is one greedy
request through that route; :func:`outcome` sorts a finished request against one update.
Used by ``fastsync weight-transfer-bench --serve`` (``fastsync.bench.wt_serve_bench``) and the
``vllm serve`` tests.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from fastsync.errors import FastSyncError

__all__ = ["VllmServe", "generate", "outcome", "free_port", "OUTCOMES"]

#: how a request in flight during an update ended (``outcome``)
OUTCOMES = ("finished_on_old", "finished_across", "aborted")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing is bound to on ``host`` just now ("": on no IPv4 address at all, for a
    server that listens on every address)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class VllmServe:
    """``vllm serve MODEL_DIR`` on loopback with the fastsync backend (see the module doc)."""

    def __init__(self, model_dir: str, *, log_path: str | os.PathLike, tp: int = 1, env: dict | None = None,
                 max_model_len: int = 512, start_timeout_s: float = 420.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        # nobind: vLLM's automatic CPU binding asserts on a one-NUMA host and pins co-located
        # workers to one core; the job secret reaches the workers through the environment
        self.env = {**os.environ, **(env or {}), "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
        argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
                "--host", "127.0.0.1", "--port", str(self.port), "--served-model-name", "tiny",
                "--skip-tokenizer-init", "--dtype", "float32", "--enforce-eager",
                "--max-model-len", str(max_model_len), "--kv-cache-memory-bytes", str(64 << 20), "--seed", "0",
                "--tensor-parallel-size", str(tp), "--enable-scale-out",
                "--weight-transfer-config", json.dumps({"backend": "fastsync"})]
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(argv, env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        try:
            self._wait_healthy(start_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise FastSyncError(f"vllm serve exited ({self.proc.returncode}):\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise FastSyncError(f"vllm serve did not answer /health within {timeout_s:.0f} s:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1)

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def get(self, path: str, timeout_s: float = 60.0) -> dict:
        with urllib.request.urlopen(self.url + path, timeout=timeout_s) as r:
            return json.loads(r.read())

    def stop(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(10)
        self._log.close()

    def __enter__(self) -> "VllmServe":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def generate(url: str, prompt: list[int], max_tokens: int, timeout_s: float = 300.0,
             on_token: Any = None) -> dict:
    """One greedy request, streamed through ``/inference/v1/generate``: ``token_ids``,
    ``finish_reason``, ``versions`` (vLLM's ``weight_versions`` as ``[[label, first_token_index],
    ...]``, on the last chunk), ``arrived`` (``time.time()`` when each token came: what the host
    saw generated when) and ``finished_at``; ``on_token()`` is called as tokens come."""
    body = {"token_ids": list(prompt), "stream": True,
            "sampling_params": {"max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}}
    req = urllib.request.Request(url + "/inference/v1/generate", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    out: dict[str, Any] = {"token_ids": [], "arrived": [], "finish_reason": None, "versions": []}
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        for line in r:
            line = line.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            now = time.time()
            choice = json.loads(line[5:])["choices"][0]
            toks = list(choice.get("token_ids") or [])
            out["token_ids"] += toks
            out["arrived"] += [now] * len(toks)
            if toks and on_token is not None:
                on_token()
            if choice.get("finish_reason") is not None:
                out["finish_reason"] = choice["finish_reason"]
            if choice.get("weight_versions"):
                out["versions"] = [[s["version"], int(s["start"])] for s in choice["weight_versions"]]
    out["finished_at"] = time.time()
    return out


def outcome(done: dict, new_label: str) -> str:
    """How a request that was in flight during the update to ``new_label`` ended: ``aborted``,
    ``finished_across`` (its tokens carry the new label after an old one: kept across the
    flip) or ``finished_on_old`` (every token from the old weights)."""
    labels = [v for v, _ in done["versions"]]
    if done["finish_reason"] == "abort":
        return "aborted"
    if new_label in labels[1:]:
        return "finished_across"
    if new_label in labels:  # it began after the flip: it was not in flight
        raise FastSyncError(f"request began on {new_label!r}, after the update: not in flight ({done['versions']})")
    return "finished_on_old"
