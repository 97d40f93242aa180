"""Rollout side of the in-place path: verl's own vLLM server (``vLLMHttpServer``, AsyncLLM)
running the composed worker extension is driven so the trainer ranks' writes land in the live
engine tensors.

Who does what, per sync (verl's ``CheckpointEngineManager.update_weights``, backend ``fastsync``):

* Every rollout rank's ``CheckpointEngineWorker`` runs ``receive_weights`` and hands the result
  to its server adapter (verl's vLLM ``ServerAdapter``). :func:`install` wraps
  ``ServerAdapter.update_weights``: when it gets fastsync's receive object it lets the backend
  decide (:func:`capability`) and, in place, the *replica leader* (the rank verl gives the
  server handle, ``_has_server``) serves the trainers' requests (``fastsync.serve_engine``) with
  :class:`ServerEngine`; anything else goes to verl's own ``update_weights`` unchanged.
* :class:`ServerEngine` answers describe / connect / update / version by calling
  ``vLLMHttpServer.collective_rpc("fastsync_verl_call", ...)``. verl's ``collective_rpc`` drops
  the workers' return values, so each worker publishes its reply in fastsync's control store
  (``fastsync_verl.extension``) and :class:`ServerEngine` reads them there.

The fence (``update``), on the real mechanisms of vLLM 0.32 and verl 0.9.1:

1. ``AsyncLLM.pause_generation(mode="abort", clear_cache=True)`` on the server's engine, unless
   the engine is already paused (``AsyncLLM.is_paused()``; verl's manager pauses first through
   ``vLLMHttpServer.abort_all_requests`` on the vLLM versions it supports). verl 0.9.1's
   ``abort_all_requests`` calls ``pause_generation(wait_for_inflight_requests=False, ...)``,
   an argument vLLM 0.32 no longer has (TypeError), so fastsync reaches ``pause_generation``
   itself: through Ray's ``__ray_call__`` on the server actor, scheduled on the actor's event
   loop (the loop AsyncLLM's output handler runs on). In-flight requests are aborted (verl
   resubmits them: partial rollout), new ones queue and are not scheduled.
2. The update is ONE ``collective_rpc``: vLLM runs it as a utility call inside
   ``EngineCore.run_busy_loop`` (``_process_input_queue``), between two
   ``_process_engine_step`` calls, so no forward pass runs while the workers open the version,
   wait for every write, repack and flip (``fastsync_update``).
3. ``vLLMHttpServer.clear_kv_cache`` (prefix / multimodal / encoder caches computed with the
   old weights), ``set_global_steps`` (verl's record of the weights' version), then
   ``resume_generation`` only if step 1 paused. The time between pause and resume is the
   engine's stall (``last_stall_s``).

A failed sync leaves every worker on its last complete version (the extension rolls back) and
the engine is resumed all the same.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from typing import Any

from fastsync import ConfigError, SyncError, one_version, raise_worker_errors

__all__ = ["ServerEngine", "capability", "install", "installed", "SERVER_ADAPTER"]

log = logging.getLogger("fastsync_verl")

SERVER_ADAPTER = "verl.workers.rollout.vllm_rollout.vllm_rollout.ServerAdapter"
_EXT_KEY = "actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls"
_ids = itertools.count(1)


# ---- AsyncLLM pause / resume on verl's server actor -----------------------------------------
def _on_engine_loop(server: Any, what: str, coro_fn: Any, timeout_s: float) -> Any:
    """Run ``coro_fn(engine)`` (an AsyncLLM coroutine) on the server actor's event loop and
    return its result. Runs inside the actor through ``__ray_call__`` (a thread of the actor,
    not its loop), so it schedules the coroutine on the loop AsyncLLM's output handler runs on."""
    import ray

    def call(self: Any) -> Any:
        engine = getattr(self, "engine", None)
        handler = getattr(engine, "output_handler", None)
        if engine is None or handler is None:
            raise SyncError(f"verl's vLLM server has no running AsyncLLM to {what} (node rank "
                            f"{getattr(self, 'node_rank', '?')}, or the server is not launched)")
        fut = asyncio.run_coroutine_threadsafe(coro_fn(engine), handler.get_loop())
        return fut.result(timeout_s)

    return ray.get(server.__ray_call__.remote(call), timeout=timeout_s + 30)


def is_paused(server: Any, timeout_s: float = 60.0) -> bool:
    return bool(_on_engine_loop(server, "ask whether it is paused", lambda e: e.is_paused(), timeout_s))


def pause(server: Any, timeout_s: float = 60.0) -> None:
    """``AsyncLLM.pause_generation(mode="abort", clear_cache=True)``: in-flight requests aborted,
    new ones queued and not scheduled until :func:`resume`."""
    _on_engine_loop(server, "pause", lambda e: e.pause_generation(mode="abort", clear_cache=True), timeout_s)


def resume(server: Any, timeout_s: float = 60.0) -> None:
    _on_engine_loop(server, "resume", lambda e: e.resume_generation(), timeout_s)


# ---- the engine handle the leader serves ----------------------------------------------------
class ServerEngine:
    """describe / connect / update / version of one verl vLLM server (one replica) for
    ``fastsync.serve_engine``: every call goes through ``collective_rpc("fastsync_verl_call")``
    and the workers' replies come back through the control store ``control``."""

    def __init__(self, server: Any, control: Any, *, engine_id: str, workers: int, timeout_s: float,
                 global_steps: int | None = None) -> None:
        self.server = server
        self.control = control  # the session's TCPStoreControl (prefix included)
        self.engine_id = engine_id
        self.workers = workers
        self.timeout_s = timeout_s
        self.global_steps = global_steps
        self.last_stall_s = 0.0
        self.last_version = 0
        self.last_paused_here = False  # the last update paused AsyncLLM itself (verl had not)

    def _call(self, method: str, *args: Any, timeout_s: float | None = None) -> list[Any]:
        import ray

        t = self.timeout_s if timeout_s is None else timeout_s
        reply = f"verl/reply/{self.engine_id}/{next(_ids)}-{time.monotonic_ns()}"
        secret = self.control.secret.hex()
        request = {"method": method, "args": list(args), "reply": reply,
                   "control": [self.control.host, self.control.port, secret, self.control.prefix]}
        what = f"verl vLLM server {self.engine_id}: {method}"
        try:
            ray.get(self.server.collective_rpc.remote("fastsync_verl_call", timeout=t + 5, args=(request,)),
                    timeout=t + 30)
        except ray.exceptions.GetTimeoutError as e:
            raise SyncError(f"{what}: no answer within {t + 30:.0f} s") from e
        except ray.exceptions.RayError as e:  # e.g. an engine without fastsync_verl_call (wrong extension)
            raise SyncError(f"{what} failed in verl's server: {type(e).__name__}: {str(e)[-400:]}") from e
        got = [json.loads(self.control.get(f"{reply}/{w}", 30.0, what=f"{what} (reply of worker {w})"))
               for w in range(self.workers)]
        return raise_worker_errors(got, what)

    def describe(self, options: dict | None = None) -> list[dict]:
        return self._call("fastsync_describe", options or {})

    #: verl's server pauses with ``abort`` (its partial rollout resubmits the aborted requests);
    #: ``wait`` / ``keep`` are refused by name at connect, before any byte moves
    pause_modes = ("abort",)

    def connect(self, plan_json: str, options: dict) -> list[dict]:
        options = dict(options)
        mode = options.pop("pause_mode", "abort")
        if mode not in self.pause_modes:
            raise ConfigError(f"pause_mode={mode!r}: verl's vLLM server cannot pause that way (it can: "
                              f"{list(self.pause_modes)}: fastsync pauses it with "
                              "AsyncLLM.pause_generation(mode='abort') and verl resubmits the aborted requests)")
        return self._call("fastsync_connect", plan_json, options)

    def update(self, version: int, timeout_s: float = 60.0) -> list[dict]:
        """Fenced update (module doc): pause unless paused, one collective_rpc that opens the
        version, waits for every write, repacks and flips, then clear caches, record the
        version with verl, resume if this call paused."""
        t0 = time.perf_counter()
        paused_here = not is_paused(self.server)
        self.last_paused_here = paused_here
        try:
            if paused_here:
                pause(self.server)
                if not is_paused(self.server):  # checked, never assumed: no write while AsyncLLM schedules
                    raise SyncError(f"verl vLLM server {self.engine_id}: AsyncLLM still schedules after "
                                    f"pause_generation; version {version} not opened")
            got = self._call("fastsync_update", version, timeout_s, timeout_s=timeout_s + 10)
            import ray

            ray.get(self.server.clear_kv_cache.remote(), timeout=60)
            steps = version if self.global_steps is None else self.global_steps
            ray.get(self.server.set_global_steps.remote(steps), timeout=60)
            self.last_version = version
            return [{**g, "paused_by_fastsync": paused_here} for g in got]
        finally:
            if paused_here:
                resume(self.server)
            self.last_stall_s = time.perf_counter() - t0

    def version(self) -> int:
        return one_version(self._call("fastsync_version"), f"verl vLLM server {self.engine_id}")

    def generate(self, prompts: list[list[int]], max_tokens: int = 8) -> list[list[int]]:
        import ray

        out = []
        for i, p in enumerate(prompts):
            r = ray.get(self.server.generate.remote(
                prompt_ids=list(p), request_id=f"fastsync-{self.engine_id}-{next(_ids)}-{i}",
                sampling_params={"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True}),
                timeout=self.timeout_s)
            out.append(list(r.token_ids))
        return out


# ---- which rollout ranks can take the in-place path -----------------------------------------
def capability(adapter: Any) -> tuple[bool, str, bool, int]:
    """``(in_place, why_not, leader, workers)`` for one rollout rank's verl server adapter."""
    from fastsync_verl.extension import EXTENSION_PATH, check_extension

    cfg = getattr(adapter, "config", None)
    if cfg is None:
        return False, f"server adapter {type(adapter).__name__} has no rollout config", False, 0
    if getattr(cfg, "name", "vllm") != "vllm":
        return False, f"rollout.name={cfg.name!r}: the in-place path drives vLLM only", False, 0
    ext = ((cfg.get("engine_kwargs", {}) or {}).get("vllm", {}) or {}).get("worker_extension_cls")
    try:
        check_extension(ext)
    except ConfigError as e:
        return False, str(e), False, 0
    for key, n in (("data_parallel_size", cfg.data_parallel_size),
                   ("pipeline_model_parallel_size", cfg.pipeline_model_parallel_size)):
        if int(n or 1) != 1:
            return False, f"rollout.{key}={n}: the in-place path serves one engine per replica, no PP", False, 0
    disagg = getattr(cfg, "disaggregation", None)
    if disagg is not None and getattr(disagg, "enabled", False):
        return False, "rollout.disaggregation (PD) is enabled", False, 0
    lora = getattr(getattr(adapter, "model_config", None), "lora", None) or {}
    if int(lora.get("rank", 0) or 0) > 0 or int(getattr(adapter.model_config, "lora_rank", 0) or 0) > 0:
        return False, "LoRA adapters: verl loads them through its own path", False, 0
    leader = bool(getattr(adapter, "_has_server", False))
    # a replica across nodes (verl's nnodes > 1): the servers on node ranks > 0 run vLLM headless and
    # their engine workers belong to node rank 0's engine (vLLM's multi-node executor), so the leader
    # (rollout rank 0, on node rank 0) drives every worker of the replica; the other ranks only join
    if leader and int(getattr(adapter, "node_rank", 0) or 0) != 0:
        return False, (f"replica leader on node rank {adapter.node_rank}: that server runs vLLM headless, "
                       "with no engine to drive"), False, 0
    workers = int(cfg.tensor_model_parallel_size or 1)
    log.debug("fastsync: %s in place with %s", EXTENSION_PATH, workers)
    return True, "", leader, workers


# ---- the ServerAdapter hook -----------------------------------------------------------------
_ORIGINAL: dict[str, Any] = {}


def installed() -> bool:
    return "update_weights" in _ORIGINAL


def install() -> bool:
    """Wrap verl's vLLM ``ServerAdapter.update_weights`` (once per process) so fastsync's receive
    object is served in place; returns False where verl's vLLM adapter is not imported (SGLang,
    a stand-in adapter): then the receive object is consumed as verl's tensors (full-tensor path)."""
    import sys

    if installed():
        return True
    mod = sys.modules.get(SERVER_ADAPTER.rpartition(".")[0])
    cls = getattr(mod, "ServerAdapter", None) if mod is not None else None
    if cls is None:
        return False
    original = cls.update_weights
    _ORIGINAL["update_weights"] = original

    async def update_weights(self: Any, weights: Any, global_steps: int | None = None,
                             wire_format: str = "named_tensors", **kwargs: Any) -> Any:
        run = getattr(weights, "fastsync_serve", None)
        if run is None:
            return await original(self, weights, global_steps=global_steps, wire_format=wire_format, **kwargs)

        async def fallback(tensors: Any) -> Any:
            return await original(self, tensors, global_steps=global_steps, wire_format=wire_format, **kwargs)

        return await run(self, fallback)

    update_weights.__wrapped__ = original  # type: ignore[attr-defined]
    cls.update_weights = update_weights
    return True
