"""The engine handle behind fastsync's trainer side of vLLM's weight-transfer API.

:class:`ClientEngine` is what :class:`~fastsync.sync.weight_sync.WeightSync` drives on trainer
rank 0 (describe, connect, begin/wait update), made of a vLLM weight-sync client (anything with
its four methods: ``HTTPVLLMWeightSyncClient``, ``RayVLLMWeightSyncClient``,
:class:`LLMWeightSyncClient`) plus fastsync's control store, which carries what the client calls
cannot return (the workers' descriptions, results and errors, and with staged receive the version
to open and when its writes landed). The pause around the flip is vLLM's own, taken through
:mod:`fastsync.engines.vllm.wt_pause`.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from vllm.distributed.weight_transfer.base import WeightTransferInitRequest, WeightTransferUpdateRequest

from fastsync.control import TCPStoreControl
from fastsync.engines.vllm.wt_keys import (
    PUBLISH_S,
    connect_key,
    connected_key,
    describe_key,
    error_text,
    open_key,
    raise_error_text,
    staged_key,
    version_key,
)
from fastsync.engines.vllm.wt_pause import Pauser
from fastsync.errors import ConfigError, SyncError
from fastsync.sync.pause_modes import PAUSE_MODES, check_pause_mode

__all__ = ["ClientEngine", "LLMWeightSyncClient", "describe_error"]

log = logging.getLogger(__name__)


def describe_error(e: BaseException) -> str:
    """``Type: message``, plus the body of an HTTP error response (vLLM puts the worker's error
    there; ``HTTPVLLMWeightSyncClient`` raises ``requests.HTTPError``, whose message has only the
    status)."""
    text = f"{type(e).__name__}: {e}"
    body = getattr(getattr(e, "response", None), "text", None)
    if isinstance(body, str) and body.strip():
        text += f" ({body.strip()[:800]})"
    return text


class _Call:
    """One client call on its own thread (the vLLM side blocks in it while the trainers work)."""

    def __init__(self, what: str, fn: Callable[[], Any]) -> None:
        self.what = what
        self.error: BaseException | None = None
        self.result: Any = None
        self._thread = threading.Thread(target=self._run, args=(fn,), name=f"fastsync-{what}", daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self.result = fn()
        except BaseException as e:  # handed to the waiter
            self.error = e

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise SyncError(f"vLLM client call {self.what} did not return within {timeout_s:.0f} s")


class ClientEngine:
    """The engine handle :class:`WeightSync` drives (describe, connect, begin/wait update), made
    of a vLLM weight-sync client (anything with its four methods) plus the control store: the
    client carries the calls, the store what they cannot return (the workers' descriptions,
    results and errors)."""

    def __init__(self, client: Any, control: TCPStoreControl, init_info: dict, timeout_s: float, *,
                 pause_mode: str | None = None, pauser: Pauser | None = None) -> None:
        if pause_mode is not None and pauser is None:
            raise ConfigError(f"pause_mode={pause_mode!r} needs a way to pause the engine (wt_pause.pauser_for)")
        self.client = client
        self.control = control
        self.init_info = dict(init_info)
        self.timeout_s = timeout_s
        self.pause_mode = pause_mode
        self.pauser = pauser
        self.staged = False  # set at connect (WeightSync(staged=True) asks the workers for it)
        self.label: str | None = None  # vLLM's weight_version for the next update (finish_weight_update)
        self.num_ranks = 0
        self.attempted = 0
        self.described: list[dict] = []
        #: per update: version, staged, pause_mode, paused_by (fastsync / host / None), transfer_s
        #: (start to every write landed), drain_s (vLLM's pause call; under wait the requests in
        #: flight finishing), stall_s (generation blocked: pause returned to resume returned, or the
        #: update calls themselves when fastsync did not pause), and the wall-clock start / paused /
        #: resumed / end (time.time()). Under wait, a drain longer than the sync's timeout_s fails it.
        self.history: list[dict] = []
        self._init: _Call | None = None
        self._updates: dict[int, _Call] = {}

    def _wait_key(self, key: str, call: _Call | None, what: str, deadline: float) -> bytes:
        """``key``'s value; the worker's own error when it wrote one; the client's error when its
        call failed without one; SyncError at ``deadline``."""
        while True:
            raw = self.control.try_get(key)
            if raw is not None:
                if raw.startswith(b"err:"):
                    raise_error_text(raw, what)
                return raw
            if call is not None and call.done and call.error is not None:
                time.sleep(0.05)  # the worker publishes its error before its RPC returns
                raw = self.control.try_get(key)
                if raw is not None and raw.startswith(b"err:"):
                    raise_error_text(raw, what)
                raise SyncError(f"{what}: vLLM's {call.what} failed: {describe_error(call.error)}") from call.error
            if time.monotonic() >= deadline:
                raise SyncError(f"{what}: no answer under {key!r} within {self.timeout_s:.0f} s")
            time.sleep(0.005)

    def describe(self, options: dict | None = None) -> list[dict]:
        if (options or {}).get("rank_offset", 0):
            raise ConfigError("the fastsync vLLM backend drives one engine per trainer set-up (rank_offset 0)")
        self._init = _Call("init_weight_transfer_engine", lambda: self.client.init_weight_transfer_engine(self.init_info))
        deadline = time.monotonic() + self.timeout_s
        first = json.loads(self._wait_key(describe_key(0), self._init, "vLLM engine rank 0 (describe)", deadline))
        self.num_ranks = int(first["num_ranks"])
        got = [first] + [json.loads(self._wait_key(describe_key(r), self._init, f"vLLM engine rank {r} (describe)",
                                                   deadline)) for r in range(1, self.num_ranks)]
        self.attempted = max(int(d.get("attempted", 0)) for d in got)
        self.described = got
        return got

    def connect(self, plan_json: str, options: dict) -> list[dict]:
        """Check the pause mode against what every worker said it can honour (before the plan is
        sent: nothing registered, nothing moved), then hand the plan to the workers."""
        assert self._init is not None, "describe() first"
        if self.pause_mode is not None:
            modes = [m for m in PAUSE_MODES if all(m in d.get("pause_modes", PAUSE_MODES) for d in self.described)]
            why = next((d["pause_modes_why"] for d in self.described if d.get("pause_modes_why")), "")
            check_pause_mode(self.pause_mode, tuple(modes), "the vLLM engine" + (f": {why}" if why else ""),
                             key="FastSyncTrainerInitInfo.pause_mode")
        self.staged = bool(options.get("staged"))
        self.control.set(connect_key(), json.dumps({"plan": plan_json, "options": options}))
        deadline = time.monotonic() + self.timeout_s
        out = [json.loads(self._wait_key(connected_key(r), self._init, f"vLLM engine rank {r} (connect)", deadline))
               for r in range(self.num_ranks)]
        self._init.join(max(deadline - time.monotonic(), 1.0))
        if self._init.error is not None:
            raise SyncError(f"vLLM init_weight_transfer_engine failed after every worker connected: "
                            f"{describe_error(self._init.error)}") from self._init.error
        return out

    def abort(self, e: BaseException) -> None:
        """Trainer rank 0 could not plan: the workers waiting for a plan get the error instead."""
        if self._init is None:
            return
        try:
            self.control.set(connect_key(), error_text(e))
            self._init.join(self.timeout_s)
        except Exception as err:  # the planning error is the one the caller raises
            log.warning("fastsync: the vLLM workers did not give up their set-up cleanly: %s", err)

    def begin_update(self, version: int, timeout_s: float = 60.0) -> int:
        rec: dict = {"version": version, "staged": self.staged, "pause_mode": self.pause_mode, "paused_by": None,
                     "start": time.time()}
        self.history.append(rec)
        self._updates[version] = _Call(f"update to version {version}", lambda: self._update(version, timeout_s, rec))
        return version

    def _update(self, version: int, timeout_s: float, rec: dict) -> None:
        """One update through vLLM's calls. Staged: ``start_weight_update`` opens the version and
        returns; the engine generates while the writes land; only when every worker said they
        landed does the pause begin, and inside it ``update_weights`` (the flip) and
        ``finish_weight_update`` (vLLM's version label, so a request kept across the flip has its
        new tokens labelled from the first one). A staged receive that failed never pauses: the
        flip then refuses on every worker (each rolls back) and vLLM's sessions end (:meth:`_flip`).
        Not staged: the pause holds the whole start / update (the transfer) / finish."""
        deadline = time.monotonic() + timeout_s
        # the workers give up before the trainer ranks do, so the trainers report the workers'
        # reason (which trainer rank's writes are missing), not their own timeout
        info = {"version": version, "timeout_s": timeout_s - min(2.0, 0.2 * timeout_s)}
        t0 = time.monotonic()
        if not self.staged:
            with self._paused(rec, deadline):
                t0 = time.monotonic()  # after the pause (under wait: after the drain)
                self.client.start_weight_update()
                self._flip(version, info)
                rec["transfer_s"] = time.monotonic() - t0
            return
        self.control.set(open_key(), json.dumps(info))
        self.client.start_weight_update()
        # the workers' own deadline started inside that call (they opened the version in it):
        # wait for their verdict from here, so a slow start on a loaded host does not let this
        # rank's clock run out first and hide the workers' reason (which trainer rank is missing)
        failed = self._wait_staged(version, max(deadline, time.monotonic() + info["timeout_s"]))
        rec["transfer_s"] = time.monotonic() - t0
        if failed is not None:  # no pause: the flip refuses on every worker, vLLM's sessions end
            rec["stall_s"] = 0.0
            try:
                self._flip(version, info)
            except Exception:  # expected: the workers published why under their version keys
                pass
            raise failed
        flipping = False
        try:
            with self._paused(rec, deadline):
                flipping = True
                self._flip(version, info)
        except BaseException:
            if not flipping:  # the pause failed: give the landed version up, end vLLM's session
                try:
                    self.client.finish_weight_update(None)
                except Exception as e:
                    log.warning("fastsync: ending vLLM's update session after a failed pause: %s", e)
            raise

    def _flip(self, version: int, info: dict) -> None:
        """``update_weights`` then ``finish_weight_update`` with vLLM's label, only when every
        worker flipped. A refusal: only the engine's last worker raises (see
        ``FastSyncWeightTransferEngine.receive_weights``), so the sessions the others kept open
        are ended here, without a label, and the workers' reasons are raised by ``wait_update``."""
        try:
            self.client.update_weights(info)
            refused = [r for r in range(self.num_ranks) if (self.control.try_get(version_key(r, version)) or b"")
                       .startswith(b"err:")]
        except BaseException:
            refused = [-1]
            raise
        finally:
            if refused:
                try:
                    self.client.finish_weight_update(None)
                except Exception:  # the last worker's session already ended with its error
                    pass
        if refused:
            raise SyncError(f"vLLM engine rank(s) {refused} refused version {version}")
        self.client.finish_weight_update(self.label)

    def _wait_staged(self, version: int, deadline: float) -> BaseException | None:
        """Until every worker published that version's writes landed (None) or one failed (its
        error); the engine generates meanwhile. SyncError at the deadline."""
        nap = 0.002
        for r in range(self.num_ranks):
            while True:
                raw = self.control.try_get(staged_key(r, version))
                if raw is not None:
                    break
                if time.monotonic() >= deadline + PUBLISH_S:  # the workers' own deadline, then their publish
                    return SyncError(f"vLLM engine rank {r}: version {version} not staged within {self.timeout_s:.0f} s")
                time.sleep(nap)  # a store request each: back off while a long transfer lands
                nap = min(2 * nap, 0.02)
            if raw.startswith(b"err:"):
                try:
                    raise_error_text(raw, f"vLLM engine rank {r} (staged version {version})")
                except SyncError as e:
                    return e
                except BaseException as e:  # another FastSyncError class
                    return e
        return None

    @contextmanager
    def _paused(self, rec: dict, deadline: float) -> Iterator[None]:
        """The engine paused in ``pause_mode`` for the body (vLLM's ``/pause?mode=`` or the
        client's equivalent), resumed after it, whatever happens; a host that has paused the
        engine itself keeps its pause (``paused_by: "host"``: no second pause, no resume). Records
        ``drain_s`` (the pause call: the engine core acts on it between two steps, after the step
        in progress; under ``wait`` it returns once the requests in flight finished on the old
        weights, new ones queued meanwhile) and ``stall_s`` (from the pause call's return to the
        resume's: no forward pass ran), as ``VllmEngine`` counts them."""
        t0 = time.monotonic()
        pauser, mode = self.pauser, self.pause_mode
        if pauser is not None and mode is not None and pauser.is_paused(5.0):
            rec["paused_by"] = "host"
            pauser = None
        if pauser is None or mode is None:  # the update call itself holds the engine core
            try:
                yield
            finally:
                rec["stall_s"] = time.monotonic() - t0
            return
        t0 = time.monotonic()
        rec["paused"] = time.time()
        try:
            pauser.pause(mode, max(deadline - t0, 1.0))
        except BaseException as e:  # e.g. wait: the requests in flight did not finish in time
            try:
                pauser.resume(10.0)  # never left paused
            except Exception as err:
                log.warning("fastsync: resume after a failed pause: %s", err)
            raise SyncError(f"FastSyncTrainerInitInfo.pause_mode={mode!r}: the engine did not pause: {e}") from e
        rec["paused_by"] = "fastsync"
        rec["drain_s"] = drain = time.monotonic() - t0
        try:
            yield
        finally:
            try:
                pauser.resume(10.0)
            finally:
                rec["resumed"] = time.time()
                rec["stall_s"] = time.monotonic() - t0 - drain

    def wait_update(self, token: int, timeout_s: float = 60.0) -> list[dict]:
        call = self._updates.pop(token)
        deadline = time.monotonic() + timeout_s + 10.0
        results = [json.loads(self._wait_key(version_key(r, token), call, f"vLLM engine rank {r} (version {token})",
                                             deadline)) for r in range(self.num_ranks)]
        call.join(max(deadline - time.monotonic(), 1.0))
        rec = next((h for h in reversed(self.history) if h["version"] == token), {})
        rec["end"] = time.time()
        if call.error is not None:
            raise SyncError(f"vLLM update to version {token}: {describe_error(call.error)}") from call.error
        for r in results:  # each worker's reply carries this update's pause figures
            r.update({k: rec[k] for k in ("stall_s", "drain_s", "transfer_s", "paused_by") if k in rec})
        return results

    def version(self) -> int:
        return self.attempted


class LLMWeightSyncClient:
    """vLLM's client protocol over an in-process ``vllm.LLM`` (vLLM ships HTTP and Ray clients)."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info))

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        self.llm.update_weights(WeightTransferUpdateRequest(update_info=update_info))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)

    def shutdown_weight_transfer_engine(self) -> None:
        self.llm.shutdown_weight_transfer_engine()
