"""The handles of a vLLM engine running :class:`~fastsync.engines.vllm.FastSyncWorkerExtension`.

``WeightSync`` (trainer side) talks to engines through a handle with five calls: ``describe``,
``connect``, ``begin_update`` / ``wait_update`` and ``version``. Two handles:

* :class:`VllmEngine` wraps a ``vllm.LLM`` in the same process. It is also the update fence for
  the offline ``LLM``: around the part of an update that must not overlap a forward pass (the
  flip with ``staged=True``, the whole transfer without) it pauses vLLM's engine core in the
  job's pause mode (``abort`` / ``wait`` / ``keep``, ``fastsync.engines.vllm.pause``), so no
  step runs while weights change, and labels every later output with the new version;
  ``complete`` returns each request's tokens with the versions that made them.
* :class:`~fastsync.engines.vllm.remote.RemoteEngine` (``remote.py``) reaches a
  :class:`VllmEngine` in another process through the control plane, signed with the job secret.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fastsync.engines.vllm.pause import DEFAULT_PAUSE_MODE, check_pause_mode, completion_record, core_call
from fastsync.errors import SyncError
from fastsync.host.replies import one_version, raise_worker_errors

log = logging.getLogger(__name__)

__all__ = ["VllmEngine"]


class VllmEngine:
    """One in-process ``vllm.LLM`` started with the fastsync worker extension."""

    def __init__(self, llm: Any, *, rank_offset: int = 0, lock_timeout_s: float = 600.0) -> None:
        from fastsync.engines.vllm.pause import supported_pause_modes

        self.llm = llm
        self.rank_offset = rank_offset
        self.lock_timeout_s = lock_timeout_s  # how long a call waits for the fence before SyncError
        # the fence: one call into the engine core at a time (adds, output steps, RPCs); with an
        # in-process core, generate() holds it for the whole call
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[threading.Thread, list]] = {}
        self.staged = False  # connected with staged=True: updates hold the fence only for the flip
        self.pause_modes, self._why_not = supported_pause_modes(llm)
        self._mp = len(self.pause_modes) > 1  # engine core in its own process: paused by utility calls
        self.pause_mode = DEFAULT_PAUSE_MODE  # set per job at connect (WeightSync(pause_mode=...))
        self.last_stall_s = 0.0  # how long the last update held generation back
        self.history: list[dict] = []  # per update: version, start/end/flip (time.time()), stall_s, requests
        self._ids = itertools.count(1)
        self._done: dict[str, dict] = {}  # finished requests not yet picked up by their generate()
        self._in_flight: set[str] = set()
        self.finished: deque[dict] = deque(maxlen=10_000)  # recent completions, for per-sync outcomes
        self._lora_engine: Any = None  # lora(): the handle on this engine's LoRA verbs, made once

    @contextmanager
    def _fenced(self, what: str) -> Iterator[None]:
        """Hold the fence for ``what``; SyncError if another call (e.g. an update whose
        ``wait_update`` timed out, still running on its thread) keeps it past ``lock_timeout_s``."""
        deadline = time.monotonic() + self.lock_timeout_s
        while not self._lock.acquire(timeout=max(0.0, min(0.5, deadline - time.monotonic()))):
            dead = self._dead_engine_pids()
            if dead:  # the call holding the fence waits on a dead engine: do not wait out its deadline
                raise SyncError(f"{what}: the vLLM engine (rank offset {self.rank_offset}) is dead: its engine-core "
                                f"process(es) {dead} exited while another request held the fence")
            if time.monotonic() >= deadline:
                raise SyncError(f"{what}: the vLLM engine (rank offset {self.rank_offset}) is still busy with another "
                                f"request (an update or generate) after {self.lock_timeout_s:.0f} s")
        try:
            yield
        finally:
            self._lock.release()

    def _dead_engine_pids(self) -> list[int]:
        """PIDs of this engine's engine-core processes that have exited ([] when vLLM does not say
        which processes it runs, e.g. an in-process engine core)."""
        try:
            procs = list(getattr(self.llm.llm_engine.engine_core.resources.engine_manager, "processes", []))
        except AttributeError:
            return []
        return [p.pid for p in procs if p.exitcode is not None]

    def _rpc(self, method: str, *args: Any, what: str = "") -> list[Any]:
        """Call the extension on every worker, waiting at most ``lock_timeout_s`` for the answers."""
        try:
            got = self.llm.collective_rpc(method, timeout=self.lock_timeout_s, args=args)
        except TimeoutError as e:
            raise SyncError(f"{what or method}: the vLLM workers (rank offset {self.rank_offset}) did not answer "
                            f"within {self.lock_timeout_s:.0f} s") from e
        return raise_worker_errors(got, what or method)

    # ---- the handle WeightSync uses -------------------------------------------------------
    def describe(self, options: dict | None = None) -> list[dict]:
        """Every worker's engine tensors (checked against the live model), in worker order."""
        opts = {"rank_offset": self.rank_offset, **(options or {})}
        with self._fenced("vLLM engine describe"):
            return self._rpc("fastsync_describe", opts, what="vLLM engine describe")

    def connect(self, plan_json: str, options: dict) -> list[dict]:
        """Connect every worker; ``options["pause_mode"]`` (WeightSync's, default ``wait``) is this
        handle's: checked here, before any byte moves, and not passed to the workers."""
        options = dict(options)
        mode = options.pop("pause_mode", DEFAULT_PAUSE_MODE)
        check_pause_mode(mode, self.pause_modes, f"this vLLM engine{': ' + self._why_not if self._why_not else ''}")
        with self._fenced("vLLM engine connect"):
            got = self._rpc("fastsync_connect", plan_json, options, what="vLLM engine connect")
            if self._mp:  # vLLM labels every output with this until the next flip
                served = int(self.llm.collective_rpc("fastsync_version")[0])
                self._core("set_weight_version", str(served), what="vLLM engine connect")
        self.staged = bool(options.get("staged"))
        self.pause_mode = mode
        return got

    def _core(self, method: str, *args: Any, what: str, timeout_s: float | None = None) -> Any:
        """A utility call into the engine-core process, bounded (the caller holds the fence)."""
        return core_call(self.llm.llm_engine.engine_core, method, *args, what=what,
                         timeout_s=self.lock_timeout_s if timeout_s is None else timeout_s)

    @contextmanager
    def _paused(self, version: int | None, what: str, deadline: float) -> Iterator[dict]:
        """Pause the engine core in this job's mode (vLLM's ``pause_scheduler``; caches cleared so
        kept requests are recomputed on the new weights), yield, label outputs with ``version``
        if the body flipped (``box["flipped"]``), resume. ``box`` gets ``drain_s`` (the pause
        call: under ``wait``, the requests in flight finishing) and ``in_flight`` (the ids of the
        requests in flight when the pause began)."""
        box: dict = {"flipped": False, "drain_s": 0.0, "in_flight": sorted(self._in_flight)}
        if not self._mp:  # in-process core: generate() holds the fence, nothing is in flight
            yield box
            # as pause_scheduler(clear_cache=True) does for a core in its own process: no request
            # after the flip reuses prefix-cached KV computed by the old weights
            if box["flipped"] and not self.llm.reset_prefix_cache():
                log.warning("%s: vLLM did not reset its prefix cache after the flip", what)
            return
        t0 = time.monotonic()
        try:
            self._core("pause_scheduler", self.pause_mode, True, what=f"{what} (pause, mode {self.pause_mode!r})",
                       timeout_s=max(1.0, deadline - t0))
        except BaseException:  # e.g. wait: the requests in flight did not finish by the deadline
            self._core("resume_scheduler", what=f"{what} (resume after a failed pause)")  # never left paused
            raise
        box["drain_s"] = time.monotonic() - t0
        try:
            yield box
            if box["flipped"]:  # (version None: whatever the workers now serve, e.g. after a reload)
                served = int(self.llm.collective_rpc("fastsync_version")[0]) if version is None else version
                self._core("set_weight_version", str(served), what=f"{what} (label)")
        finally:
            self._core("resume_scheduler", what=f"{what} (resume)")

    def update(self, version: int, timeout_s: float = 60.0) -> list[dict]:
        """Fenced update: begin, wait for every write, post-process and flip, on every worker,
        with the engine paused in this job's mode. Raises the workers' SyncError when the sync
        failed (they keep their previous version)."""
        what = f"vLLM engine update to version {version}"
        start = time.time()
        entry: dict = {"version": version, "start": start, "staged": self.staged, "pause_mode": self.pause_mode}
        self.last_stall_s = 0.0
        try:
            if self.staged:
                return self._staged_update(version, timeout_s, what, entry)
            deadline = time.monotonic() + timeout_s
            box: dict = {}
            with self._fenced(what):
                t0 = time.monotonic()
                try:
                    with self._paused(version, what, deadline) as box:
                        entry["flip"] = time.time()
                        got = self._rpc("fastsync_update", version, timeout_s, what=what)
                        box["flipped"] = True
                finally:
                    self._stalled(entry, box, time.monotonic() - t0)
            return [{**g, "stall_s": self.last_stall_s, "drain_s": entry["drain_s"]} for g in got]
        finally:
            entry.update(end=time.time(), stall_s=self.last_stall_s)
            self.history.append(entry)

    def _staged_update(self, version: int, timeout_s: float, what: str, entry: dict) -> list[dict]:
        """Staged receive: open the version (a short call), let generation go on while the writes
        land off the live model (asking, between generate calls, whether they all did), then
        pause the engine in this job's mode only for the flip: ``stall_s`` in every worker's
        reply is that time; under ``wait`` the pause first lets the requests in flight finish on
        the old version while new ones queue (``drain_s``, not counted as stall)."""
        deadline = time.monotonic() + timeout_s
        with self._fenced(f"{what} (open)"):
            self._rpc("fastsync_stage", version, timeout_s, what=what)
        nap = 0.002
        while time.monotonic() < deadline + 1.0:
            with self._fenced(f"{what} (landed?)"):
                ready = self._rpc("fastsync_stage_ready", version, what=what)
            if all(r.get("done") for r in ready):
                break
            # each ask is a utility call between two engine steps (through every worker): back
            # off so the asking does not slow the generation it is meant to let run
            time.sleep(nap)
            nap = min(2 * nap, 0.05 if self._in_flight else 0.005)
        box: dict = {}
        with self._fenced(f"{what} (flip)"):
            t0 = time.monotonic()
            try:
                with self._paused(version, what, deadline + 1.0) as box:
                    entry["flip"] = time.time()
                    got = self._rpc("fastsync_flip", version, max(1.0, deadline - time.monotonic()), what=what)
                    box["flipped"] = True
            finally:
                self._stalled(entry, box, time.monotonic() - t0)
        return [{**g, "stall_s": self.last_stall_s, "drain_s": entry["drain_s"]} for g in got]

    def _stalled(self, entry: dict, box: dict, held_s: float) -> None:
        """Record one update's pause: ``held_s`` new requests were held back (pause to resume),
        ``drain_s`` of it the requests in flight kept generating (``wait``), ``stall_s`` the rest,
        when no forward pass ran (the flip): generation actually blocked."""
        drain = box.get("drain_s", 0.0)
        self.last_stall_s = max(0.0, held_s - drain)
        entry.update(in_flight=box.get("in_flight", []), drain_s=drain, held_s=held_s)

    def outcomes(self, entry: dict) -> dict:
        """What one update (an entry of ``history``) did to the requests in flight when its pause
        began or finishing while it ran: finished on the old version, carried across its flip
        (``keep``), aborted by it (``abort``)."""
        v, start, end = entry["version"], entry["start"], entry.get("end", time.time())
        in_flight = set(entry.get("in_flight", ()))
        out = {"finished_on_old": 0, "finished_across": 0, "aborted": 0}
        for r in self.finished:
            if r["request_id"] not in in_flight and not start <= r["finished_at"] <= end:
                continue
            spans = [s[0] for s in r["versions"]]
            if r["finish_reason"] == "abort":
                out["aborted"] += 1
            elif v in spans[1:]:
                out["finished_across"] += 1
            elif v not in spans:
                out["finished_on_old"] += 1
        return out

    def begin_update(self, version: int, timeout_s: float = 60.0) -> int:
        """Start :meth:`update` on a helper thread (the trainers write meanwhile); returns a
        token for :meth:`wait_update`."""
        box: list = []

        def run() -> None:
            try:
                box.append(self.update(version, timeout_s))
            except BaseException as e:  # handed to wait_update
                box.append(e)

        th = threading.Thread(target=run, name=f"fastsync-update-{version}", daemon=True)
        self._pending[version] = (th, box)
        th.start()
        return version

    def wait_update(self, token: int, timeout_s: float = 60.0) -> list[dict]:
        got = self._pending.pop(token, None)
        if got is None:
            raise SyncError(f"vLLM engine wait_update: unknown token {token!r} (pending: {sorted(self._pending)}); "
                            "it was never returned by begin_update or was already waited for")
        th, box = got
        th.join(timeout_s)
        if th.is_alive():
            raise SyncError(f"vLLM engine update to version {token} did not return within {timeout_s:.0f} s")
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]

    def lora(self) -> Any:
        """This engine's LoRA verbs (``VllmLoraEngine``, one per handle; the engine needs
        ``enable_lora=True``): what ``WeightSync(peft_model)`` syncs adapters through."""
        from fastsync.engines.vllm.lora_host import VllmLoraEngine

        if self._lora_engine is None:
            self._lora_engine = VllmLoraEngine(self.llm, rank_offset=self.rank_offset)
        return self._lora_engine

    def version(self) -> int:
        """The version every worker serves; SyncError if workers disagree."""
        with self._fenced("vLLM engine version"):
            got = self.llm.collective_rpc("fastsync_version")
        return one_version(got, "vLLM engine")

    # ---- serving --------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], max_tokens: int = 8) -> list[list[int]]:
        """Greedy token ids for each prompt (``ignore_eos``, so lengths are fixed)."""
        return [c["token_ids"] for c in self.complete(prompts, max_tokens)]

    def complete(self, prompts: list[list[int]], max_tokens: int = 8, timeout_s: float | None = None) -> list[dict]:
        """Greedy completions of ``prompts``, each stamped with the weights that made it
        (:func:`fastsync.engines.vllm.pause.completion_record`: ``token_ids``, ``finish_reason``,
        ``weight_version``, ``versions`` as ``[[version, first_token_index], ...]``).

        The fence is held only to add the requests and to read each step's outputs, so an update
        can pause the engine core between two steps with these requests in flight (its pause mode
        says what happens to them). With an in-process engine core the whole call is fenced."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        deadline = time.monotonic() + (self.lock_timeout_s if timeout_s is None else timeout_s)
        if not self._mp:
            with self._fenced("vLLM engine generate"):
                outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params,
                                         use_tqdm=False)
            return [self._record(completion_record(o)) for o in outs]
        eng = self.llm.llm_engine
        ids: list[str] = []
        with self._fenced("vLLM engine generate"):
            for p in prompts:
                rid = f"fs-{next(self._ids)}"  # outputs and aborts use this (external) id; vLLM adds a suffix inside
                eng.add_request(rid, TokensPrompt(prompt_token_ids=list(p)), params)
                ids.append(rid)
                self._in_flight.add(rid)
        while True:
            if all(i in self._done for i in ids):
                return [self._done.pop(i) for i in ids]
            if time.monotonic() > deadline:
                eng.abort_request([i for i in ids if i not in self._done])
                raise SyncError(f"vLLM engine generate: {sum(i not in self._done for i in ids)} of {len(ids)} "
                                f"requests did not finish within the deadline")
            if self._lock.acquire(timeout=0.05):
                try:
                    q = eng.engine_core.outputs_queue
                    while not q.empty():  # step() would block on an empty queue (a paused engine)
                        for o in eng.step():
                            if o.finished:
                                self._in_flight.discard(o.request_id)
                                self._done[o.request_id] = self._record(completion_record(o))
                finally:
                    self._lock.release()
            time.sleep(0.002)  # the engine core steps on its own: outputs wait in the queue, not the engine

    def _record(self, rec: dict) -> dict:
        self.finished.append({**rec, "finished_at": time.time()})
        return rec
