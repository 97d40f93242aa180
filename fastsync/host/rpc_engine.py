"""One engine handle over any RPC: what ``WeightSync`` drives, for an engine whose workers answer
fastsync's calls (``fastsync_describe``, ``fastsync_connect``, ``fastsync_update``,
``fastsync_version``: the vLLM worker extension's, or a host actor forwarding them).

A host supplies two functions: ``submit(method, *args)`` starts a call and returns a handle at
once (a Ray ``ObjectRef``, a future), ``result(handle, timeout_s, what)`` waits for it with a
deadline and returns the per-worker replies (raising :class:`~fastsync.errors.SyncError` naming
``what`` on a timeout or a failed call). Worker replies that carry an error are raised by name
(``raise_worker_errors``); versions must agree (``one_version``). Over a Ray actor that forwards
the calls (``ray`` is imported only when one is used)::

    engine = RpcEngine.over_ray(actor, name="vLLM engine 0", timeout_s=120.0)
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from fastsync.errors import FastSyncError, SyncError
from fastsync.host.replies import one_version, raise_worker_errors

__all__ = ["RpcEngine", "ray_result"]

#: How much of a failed Ray call's error is kept in the SyncError (Ray's include remote tracebacks).
_RAY_ERROR_CHARS = 400
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def ray_result(ref: Any, timeout_s: float, what: str) -> Any:
    """``ray.get(ref)`` with a deadline: SyncError naming ``what`` when it does not answer within
    ``timeout_s`` or the actor call failed (the end of Ray's error kept); a fastsync error the
    actor raised comes through as it is."""
    import ray

    try:
        return ray.get(ref, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError as e:
        raise SyncError(f"{what} did not answer within {timeout_s:.0f} s") from e
    except ray.exceptions.RayError as e:
        if isinstance(e, FastSyncError):  # raised by fastsync in the actor: Ray re-raises it as its own class
            raise
        text = _ANSI.sub("", str(e))  # Ray colours the remote frame's name for a terminal
        raise SyncError(f"{what} failed: {type(e).__name__}: {text[-_RAY_ERROR_CHARS:]}") from e


class RpcEngine:
    """``describe`` / ``connect`` / ``begin_update`` + ``wait_update`` / ``version`` over ``submit``
    and ``result``. ``connect_options`` are merged into every connect (e.g. the ``control_host``
    the engine's workers join the trainers' store at)."""

    def __init__(self, submit: Callable[..., Any], result: Callable[[Any, float, str], Any], *, name: str,
                 timeout_s: float = 120.0, connect_options: dict | None = None) -> None:
        self._submit, self._result = submit, result
        self.name = name
        self.timeout_s = timeout_s
        self.connect_options = dict(connect_options or {})
        self._pending: dict[int, Any] = {}

    @classmethod
    def over_ray(cls, actor: Any, *, name: str, timeout_s: float = 120.0,
                 connect_options: dict | None = None) -> "RpcEngine":
        """The handle of a Ray actor with fastsync's calls as methods (``actor.fastsync_connect``
        ...), each awaited with :func:`ray_result`."""
        return cls(lambda method, *args: getattr(actor, method).remote(*args),
                   lambda ref, t, what: ray_result(ref, t, f"{name}: {what}"), name=name, timeout_s=timeout_s,
                   connect_options=connect_options)

    def _call(self, method: str, *args: Any, what: str, timeout_s: float | None = None) -> list[Any]:
        got = self._result(self._submit(method, *args), self.timeout_s if timeout_s is None else timeout_s, what)
        return raise_worker_errors(got, f"{self.name} {what}")

    def describe(self, options: dict | None = None) -> list[dict]:
        return self._call("fastsync_describe", options or {}, what="describe")

    def connect(self, plan_json: str, options: dict) -> list[dict]:
        return self._call("fastsync_connect", plan_json, {**options, **self.connect_options}, what="connect")

    def begin_update(self, version: int, timeout_s: float = 60.0) -> int:
        self._pending[version] = self._submit("fastsync_update", version, timeout_s)
        return version

    def wait_update(self, token: int, timeout_s: float = 60.0) -> list[dict]:
        handle = self._pending.pop(token, None)
        if handle is None:
            raise SyncError(f"{self.name}: wait_update({token}) without begin_update")
        got = self._result(handle, timeout_s + 30.0, f"update to version {token}")
        return raise_worker_errors(got, f"{self.name} update to version {token}")

    def version(self) -> int:
        return one_version(self._call("fastsync_version", what="version"), self.name)
