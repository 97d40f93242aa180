"""The pause that fastsync's trainer side takes around a flip through vLLM's weight-transfer API.

vLLM's weight-sync clients (``HTTPVLLMWeightSyncClient``, ``RayVLLMWeightSyncClient``) carry only
``init_weight_transfer_engine`` / ``start_weight_update`` / ``update_weights`` /
``finish_weight_update``: pausing is the host's business (``POST /pause?mode=abort|wait|keep``
and ``/resume`` on ``vllm serve``, ``pause_generation(mode=...)`` on ``AsyncLLM``). A host that
pauses itself around ``send_weights`` pauses for the whole transfer. With staged receive only the
trainer side knows when the writes have landed, so it takes the pause, through those same vLLM
calls, only for the flip: ``FastSyncTrainerInitInfo.pause_mode`` says which mode (``None``: the
host pauses, or nothing does).

One :class:`Pauser` per client kind, chosen by :func:`pauser_for`:

* :class:`HttpPauser`: ``vllm serve``'s own routes at the HTTP client's ``base_url``
  (``/pause?mode=M``, ``/resume``, ``/is_paused``; they need ``VLLM_SERVER_DEV_MODE=1``, as the
  weight-transfer routes do);
* :class:`EngineCorePauser`: an offline ``vllm.LLM`` whose engine core runs in its own process
  (vLLM's default): the same ``pause_scheduler`` / ``resume_scheduler`` utility calls
  ``AsyncLLM.pause_generation`` makes. With an in-process core nothing is in flight between two
  ``generate`` calls: nothing to pause (the workers then report only ``wait``);
* :class:`MethodPauser`: any other client with ``pause_generation(mode=...)`` /
  ``resume_generation()`` / ``is_paused()``.

A client with none of these cannot be paused: ``pause_mode`` other than None is refused at
``trainer_init``, naming it.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any, Protocol

from fastsync.errors import ConfigError, SyncError

__all__ = ["Pauser", "HttpPauser", "EngineCorePauser", "MethodPauser", "pauser_for", "check_pauser"]


class Pauser(Protocol):
    """Pause and resume one engine's scheduler; ``is_paused`` tells a host's own pause."""

    def pause(self, mode: str, timeout_s: float) -> None: ...

    def resume(self, timeout_s: float) -> None: ...

    def is_paused(self, timeout_s: float) -> bool: ...


class HttpPauser:
    """``vllm serve``'s ``/pause``, ``/resume`` and ``/is_paused`` (vLLM's ``rl/online/api_router``)."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url.rstrip("/")

    def _call(self, method: str, path: str, timeout_s: float) -> dict:
        req = urllib.request.Request(self.base_url + path, data=b"" if method == "POST" else None, method=method)
        try:
            with urllib.request.urlopen(req, timeout=max(timeout_s, 0.5)) as r:
                return json.loads(r.read() or b"{}")
        except urllib.error.HTTPError as e:
            body = (e.read() or b"").decode(errors="replace").strip()[:400]
            raise SyncError(f"vLLM server {self.base_url}{path}: HTTP {e.code} {body}") from e
        except (urllib.error.URLError, OSError) as e:  # includes the socket timeout
            raise SyncError(f"vLLM server {self.base_url}{path}: no answer within {timeout_s:.1f} s "
                            f"({type(e).__name__}: {e})") from e

    def pause(self, mode: str, timeout_s: float) -> None:
        self._call("POST", f"/pause?mode={mode}", timeout_s)

    def resume(self, timeout_s: float) -> None:
        self._call("POST", "/resume", timeout_s)

    def is_paused(self, timeout_s: float) -> bool:
        return bool(self._call("GET", "/is_paused", timeout_s).get("is_paused"))


class EngineCorePauser:
    """An offline ``vllm.LLM``: its engine core's ``pause_scheduler(mode, clear_cache=True)`` and
    ``resume_scheduler`` utility calls, bounded (``fastsync.engines.vllm.pause.core_call``)."""

    def __init__(self, llm: Any) -> None:
        from fastsync.engines.vllm.pause import supported_pause_modes

        self.llm = llm
        self.separate_core = len(supported_pause_modes(llm)[0]) > 1

    def _core(self, method: str, *args: Any, timeout_s: float) -> Any:
        from fastsync.engines.vllm.pause import core_call

        return core_call(self.llm.llm_engine.engine_core, method, *args, timeout_s=max(timeout_s, 0.5),
                         what="fastsync weight transfer")

    def pause(self, mode: str, timeout_s: float) -> None:
        if self.separate_core:  # in-process: generate() has returned, nothing is in flight
            self._core("pause_scheduler", mode, True, timeout_s=timeout_s)

    def resume(self, timeout_s: float) -> None:
        if self.separate_core:
            self._core("resume_scheduler", timeout_s=timeout_s)

    def is_paused(self, timeout_s: float) -> bool:
        return bool(self._core("is_scheduler_paused", timeout_s=timeout_s)) if self.separate_core else False


class MethodPauser:
    """A client that pauses its engine itself (``pause_generation`` / ``resume_generation`` /
    ``is_paused``, AsyncLLM's names)."""

    def __init__(self, client: Any) -> None:
        self.client = client

    def pause(self, mode: str, timeout_s: float) -> None:
        self.client.pause_generation(mode=mode)

    def resume(self, timeout_s: float) -> None:
        self.client.resume_generation()

    def is_paused(self, timeout_s: float) -> bool:
        return bool(self.client.is_paused())


def pauser_for(client: Any) -> Pauser | None:
    """The way to pause the engine behind ``client``; None when there is none."""
    try:
        from vllm.distributed.weight_transfer import HTTPVLLMWeightSyncClient
    except ImportError:  # pragma: no cover - the backend needs vLLM anyway
        HTTPVLLMWeightSyncClient = ()  # type: ignore[assignment,misc]
    if isinstance(client, HTTPVLLMWeightSyncClient) or (isinstance(getattr(client, "base_url", None), str)
                                                         and not hasattr(client, "pause_generation")):
        return HttpPauser(client.base_url)
    if all(callable(getattr(client, m, None)) for m in ("pause_generation", "resume_generation", "is_paused")):
        return MethodPauser(client)
    llm = getattr(client, "llm", None)
    if llm is not None and getattr(llm, "llm_engine", None) is not None:
        return EngineCorePauser(llm)
    return None


def check_pauser(client: Any, pause_mode: str | None) -> Pauser | None:
    """:func:`pauser_for`, or ConfigError naming ``pause_mode`` when the client cannot pause."""
    if pause_mode is None:
        return None
    got = pauser_for(client)
    if got is None:
        raise ConfigError(f"FastSyncTrainerInitInfo.pause_mode={pause_mode!r}: the client {type(client).__name__} "
                          "has no way to pause its engine (no base_url for vLLM's /pause route, no "
                          "pause_generation); pass pause_mode=None and pause around send_weights yourself")
    return got

