"""Host-side handle of a ``vllm serve`` replica (an OpenAI-compatible server process) started
with ``--worker-extension-cls fastsync.engines.vllm.FastSyncWorkerExtension`` and
``VLLM_SERVER_DEV_MODE=1`` (which exposes ``POST /collective_rpc``).

The same calls as :class:`~fastsync.engines.vllm.reload_host.VllmReloadEngine`, over HTTP:
peer reload, checkpoint loads, versions, and what a rolling update needs. Every call has a
deadline; errors come back as the workers' fastsync error classes.

The deadline is the host's (the HTTP request's), never vLLM's ``collective_rpc`` ``timeout``:
vLLM's multiprocess executor reads the workers' replies in order from one queue, and a call it
times out leaves its late reply there, so every later call on that replica would get the reply of
the call before it. Without that timeout a call that overruns the host's deadline fails here
(SyncError naming the replica), the engine finishes it, and the replies stay paired. Each call
carries an id the worker echoes (``fastsync_json``), so a reply of another call is refused by
name instead of being taken for this one.
"""

from __future__ import annotations

import itertools
import json
import os
import urllib.error
import urllib.request
from typing import Any

from fastsync.host.replies import one_version, raise_worker_errors
from fastsync.errors import SyncError

__all__ = ["HttpVllmEngine"]


class HttpVllmEngine:
    """``HttpVllmEngine("http://127.0.0.1:8001", name="r0")``."""

    def __init__(self, base_url: str, *, name: str, timeout_s: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.name = name
        self.timeout_s = timeout_s
        self._ids = itertools.count(1)
        self._tag = f"{os.getpid()}-{id(self):x}"

    def call(self, method: str, *args: Any, timeout_s: float | None = None) -> list[Any]:
        """``method`` on every worker; the list of their results."""
        t = self.timeout_s if timeout_s is None else timeout_s
        call_id = f"{self._tag}-{next(self._ids)}"
        # no "timeout" for vLLM: see the module doc (a timed-out collective_rpc unpairs the replies)
        body = {"method": "fastsync_json",
                "args": [json.dumps({"method": method, "args": list(args), "call_id": call_id})]}
        req = urllib.request.Request(self.base_url + "/collective_rpc", data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
        what = f"replica {self.name} ({self.base_url}): {method}"
        try:
            with urllib.request.urlopen(req, timeout=t) as r:
                got = json.loads(r.read())["results"]
        except urllib.error.HTTPError as e:
            detail = e.read(600).decode("utf-8", "replace").strip()
            raise SyncError(f"{what} failed: HTTP {e.code}: {detail or e.reason}") from e
        except (urllib.error.URLError, OSError, ValueError, KeyError) as e:
            raise SyncError(f"{what} failed: {type(e).__name__}: {e} (deadline {t:.0f} s)") from e
        out = []
        for rank, r in enumerate(got):
            if not (isinstance(r, dict) and r.get("call_id") == call_id):
                seen = r.get("call_id") if isinstance(r, dict) else None
                raise SyncError(f"{what}: worker {rank} answered call {seen!r}, not this call {call_id!r}: the "
                                f"replica's collective_rpc replies are out of step (an earlier call timed out "
                                f"inside vLLM); restart the replica")
            out.append(r["result"])
        return raise_worker_errors(out, f"replica {self.name}: {method}")

    def describe(self, options: dict | None = None) -> list[dict]:
        return self.call("fastsync_describe", options or {})

    def version(self) -> int:
        return one_version(self.call("fastsync_version"), f"replica {self.name}")

    def reload_describe(self) -> list[dict]:
        desc = self.describe()
        return [{**d, **s} for d, s in zip(desc, self.call("fastsync_reload_state"))]

    def reload_send(self, plan_json: str, options: dict) -> list[dict]:
        return self.call("fastsync_reload_send", plan_json, options)

    def reload_receive(self, plan_json: str, options: dict) -> list[dict]:
        return self.call("fastsync_reload_receive", plan_json, options)

    def load_checkpoint(self, model_dir: str, version: int = 0) -> list[dict]:
        if not getattr(self, "_described", False):
            self.describe()
            self._described = True
        return self.call("fastsync_load_checkpoint", model_dir, version)

    def alive(self) -> bool:
        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=5) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False
