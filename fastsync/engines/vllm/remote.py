"""A vLLM engine handle across processes: :class:`RemoteEngine` reaches a
:class:`~fastsync.engines.vllm.handle.VllmEngine` in another process through the control plane,
where :func:`serve` answers its requests one at a time (the engine's own fence). Every request is
signed (HMAC-SHA256, a key derived from the job secret, over engine id, sequence number and body):
:func:`serve` refuses and counts any request whose signature does not match, so only the job's own
processes can describe, connect, update or stop an engine, and a request cannot be replayed under
another number. The keys are :mod:`fastsync.protocol`'s ``engine_*``.

Example (engine process; the trainers hold ``RemoteEngine(control)``)::

    llm = LLM(model=path, worker_extension_cls=EXTENSION, ...)
    serve(VllmEngine(llm), TCPStoreControl.client(port))   # until a client sends stop()
"""

from __future__ import annotations

import json
import time
from typing import Any

from fastsync.control import ControlPlane
from fastsync.engines.vllm.pause import PAUSE_MODES
from fastsync.errors import ConfigError, SyncError
from fastsync.host.replies import error_reply, raise_worker_errors
from fastsync.protocol import engine_cmd_key, engine_reply_key, engine_seq_key
from fastsync.security import check_mac, derive_key, mac

__all__ = ["RemoteEngine", "serve"]


def _request_key(control: ControlPlane) -> bytes:
    secret = getattr(control, "secret", None)
    if not secret:
        raise ConfigError("engine requests are signed with the job secret: the control plane has none (control.secret)")
    return derive_key(secret, "engine requests")


class RemoteEngine:
    """Client of :func:`serve`: the same calls as :class:`VllmEngine`, over the control plane.
    Every pause mode may be asked for: the served engine checks it at connect."""

    pause_modes = PAUSE_MODES

    def __init__(self, control: ControlPlane, *, engine_id: str = "0", timeout_s: float = 600.0) -> None:
        self.control = control
        self.engine_id = engine_id
        self.timeout_s = timeout_s
        self._key = _request_key(control)

    def _send(self, op: str, **args: Any) -> int:
        n = self.control.add(engine_seq_key(self.engine_id), 1)
        body = json.dumps({"op": op, "args": args})
        tag = mac(self._key, "engine", self.engine_id, str(n), body).hex()
        self.control.set(engine_cmd_key(self.engine_id, n), json.dumps({"body": body, "mac": tag}))
        return n

    def _reply(self, n: int, timeout_s: float | None = None) -> Any:
        raw = self.control.get(engine_reply_key(self.engine_id, n), self.timeout_s if timeout_s is None else timeout_s,
                               what=f"vLLM engine {self.engine_id}")
        got = json.loads(raw)
        if "error" in got:
            raise_worker_errors([got], f"vLLM engine {self.engine_id}")
        return got["ok"]

    def call(self, op: str, **args: Any) -> Any:
        return self._reply(self._send(op, **args))

    def describe(self, options: dict | None = None) -> list[dict]:
        return self.call("describe", options=options or {})

    def connect(self, plan_json: str, options: dict) -> list[dict]:
        return self.call("connect", plan_json=plan_json, options=options)

    def update(self, version: int, timeout_s: float = 60.0) -> list[dict]:
        return self.call("update", version=version, timeout_s=timeout_s)

    def begin_update(self, version: int, timeout_s: float = 60.0) -> int:
        return self._send("update", version=version, timeout_s=timeout_s)

    def wait_update(self, token: int, timeout_s: float = 60.0) -> list[dict]:
        return self._reply(token, timeout_s + 5.0)

    def version(self) -> int:
        return int(self.call("version"))

    def generate(self, prompts: list[list[int]], max_tokens: int = 8) -> list[list[int]]:
        return self.call("generate", prompts=prompts, max_tokens=max_tokens)

    def complete(self, prompts: list[list[int]], max_tokens: int = 8) -> list[dict]:
        return self.call("complete", prompts=prompts, max_tokens=max_tokens)

    def stop(self) -> None:
        self._send("stop")


#: the requests :func:`serve` answers (each a method of the engine handle)
_OPS = ("describe", "connect", "update", "version", "generate", "complete")


def serve(engine: Any, control: ControlPlane, *, engine_id: str = "0", idle_timeout_s: float = 900.0,
          first: int = 1) -> int:
    """Answer :class:`RemoteEngine` requests in order, from request number ``first``, until
    ``stop`` (returns the number of the last request before it: how many were served when
    ``first`` is 1) or ``idle_timeout_s`` without a request (SyncError). A request whose
    signature does not check is answered with an error and not run. ``engine`` is a
    :class:`VllmEngine` or anything with its calls (describe, connect, update, version,
    generate); a host that serves in turns (one sync at a time) passes the returned number + 2
    as the next turn's ``first``."""
    rkey = _request_key(control)
    n = first
    while True:
        deadline = time.monotonic() + idle_timeout_s
        key = engine_cmd_key(engine_id, n)
        while (raw := control.try_get(key)) is None:
            if time.monotonic() > deadline:
                raise SyncError(f"vLLM engine {engine_id}: no request for {idle_timeout_s:.0f} s; stopping")
            time.sleep(0.002)
        try:
            req = json.loads(raw)
            signed = isinstance(req, dict) and isinstance(req.get("body"), str) and isinstance(req.get("mac"), str)
            body = req["body"] if signed else ""
            try:
                tag = bytes.fromhex(req["mac"]) if signed else b""
            except ValueError:
                tag = b""
            if not check_mac(rkey, tag, "engine", engine_id, str(n), body):
                raise SyncError(f"vLLM engine {engine_id}: request {n} refused: its signature does not match "
                                "this job's secret")
            req = json.loads(body)
            op, args = req["op"], req["args"]
            if op == "stop":
                control.set(engine_reply_key(engine_id, n), json.dumps({"ok": True}))
                return n - 1
            fn = getattr(engine, op, None) if op in _OPS else None
            if fn is None:
                raise ConfigError(f"unknown engine request {op!r}")
            reply = json.dumps({"ok": fn(**args)})
        except Exception as e:  # any failure is answered: the client must not wait out its timeout
            reply = json.dumps(error_reply(e))
        control.set(engine_reply_key(engine_id, n), reply)
        n += 1
