"""Rollout side of the in-place path: verl's own vLLM server (``vLLMHttpServer``, AsyncLLM) running
the composed worker extension is driven so the trainer ranks' writes land in the live engine
tensors. :func:`install` hooks verl's ``ServerAdapter.update_weights`` so the replica leader
serves trainer rank 0's requests with :class:`ServerEngine`; :func:`capability` says whether a
rollout rank can. The fence, step by step (vLLM 0.32 / verl 0.9.1): ``adapters/verl/README.md``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from fastsync import PAUSE_MODES, ConfigError, check_pause_mode, one_version, ray_result, store_replies
from fastsync import store_request, wrap_hook_point
from fastsync_verl import stamps
from fastsync_verl.asyncllm import after_flip, is_paused, label, pause

__all__ = ["ServerEngine", "capability", "install", "SERVER_ADAPTER"]

log = logging.getLogger("fastsync_verl")

SERVER_ADAPTER = "verl.workers.rollout.vllm_rollout.vllm_rollout.ServerAdapter"
_EXT_KEY = "actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls"


# ---- the engine handle the leader serves ----------------------------------------------------
class ServerEngine:
    """describe / connect / update / version of one verl vLLM server (one replica) for
    ``fastsync.serve_engine``: every call goes through ``collective_rpc("fastsync_verl_call")``
    and the workers' replies come back through the control store ``control``."""

    def __init__(self, server: Any, control: Any, *, engine_id: str, workers: int, timeout_s: float,
                 global_steps: int | None = None, pause_mode: str = "abort", staged: bool = False) -> None:
        self.server = server
        self.control = control  # the session's TCPStoreControl (prefix included)
        self.engine_id = engine_id
        self.workers = workers
        self.timeout_s = timeout_s
        self.global_steps = global_steps
        self.pause_mode = check_pause_mode(pause_mode, PAUSE_MODES, "verl's vLLM server")
        self.staged = staged
        self.last_stall_s = 0.0  # generation blocked: pause to resume, less the drain under wait
        self.last_drain_s = 0.0  # under wait: the requests in flight finishing on the old weights
        self.last_version = 0
        self.last_paused_here = False  # the last update paused AsyncLLM itself (verl had not)
        self.last_phases: dict[str, float] = {}  # the last update's pause, flip (or update), after-flip times

    def _call(self, method: str, *args: Any, timeout_s: float | None = None) -> list[Any]:
        t = self.timeout_s if timeout_s is None else timeout_s
        request = store_request(self.control, method, args, caller=self.engine_id)
        what = f"verl vLLM server {self.engine_id}: {method}"
        # failed, e.g., on an engine without fastsync_verl_call (wrong extension)
        ray_result(self.server.collective_rpc.remote("fastsync_verl_call", timeout=t + 5, args=(request,)), t + 30, what)
        return store_replies(self.control, request, self.workers, what)

    def describe(self, options: dict | None = None) -> list[dict]:
        return self._call("fastsync_describe", options or {})

    #: vLLM's three pause modes, through ``AsyncLLM.pause_generation(mode=...)`` (module doc)
    pause_modes = PAUSE_MODES

    def connect(self, plan_json: str, options: dict) -> list[dict]:
        """Connect every worker. The trainer's ``pause_mode`` and ``staged`` must be this rank's
        (both ends read them from the same ``engine_kwargs.fastsync``): checked before any byte moves."""
        options = dict(options)
        mode = check_pause_mode(options.pop("pause_mode", self.pause_mode), self.pause_modes, "verl's vLLM server")
        if mode != self.pause_mode or bool(options.get("staged")) != self.staged:
            raise ConfigError(f"verl vLLM server {self.engine_id}: the trainer asks pause_mode={mode!r}, "
                              f"staged={bool(options.get('staged'))} but this rollout rank was configured with "
                              f"engine_kwargs.fastsync.pause_mode={self.pause_mode!r}, staged={self.staged}")
        got = self._call("fastsync_connect", plan_json, options)
        stamps.install(self.server, self.timeout_s)  # version stamps on verl's rollout records
        served = ray_result(self.server.__ray_call__.remote(lambda srv: srv.global_steps), 60.0,
                            f"verl vLLM server {self.engine_id}: its global_steps")
        # name the weights AsyncLLM serves with verl's record of them: every completion's spans carry it
        label(self.server, self.version() if served is None else served, self.timeout_s)
        return got

    def _stage(self, version: int, timeout_s: float, deadline: float) -> None:
        """Staged receive: open ``version`` (the writes land off the live model on a thread of each
        worker) and ask, between engine steps, until every worker has it; generation goes on."""
        self._call("fastsync_stage", version, timeout_s)
        nap = 0.005
        while not all(r.get("done") for r in self._call("fastsync_stage_ready", version)):
            if time.monotonic() > deadline:
                break  # the flip ends the receive by its deadline and reports what was missing
            time.sleep(nap)
            nap = min(2 * nap, 0.05)

    def update(self, version: int, timeout_s: float = 60.0) -> list[dict]:
        """Fenced update (module doc): staged, receive first while generating; then pause in this
        job's mode unless paused, one collective_rpc that flips (staged) or opens, waits for every
        write, repacks and flips; clear caches, label and record the version, resume if this
        call paused. ``last_stall_s``: pause to resume less the ``wait`` drain."""
        deadline = time.monotonic() + timeout_s
        self.last_drain_s = 0.0
        if self.staged:
            self._stage(version, timeout_s, deadline)
        paused_here = self.last_paused_here = not is_paused(self.server)  # verl's manager may have paused it
        t0 = time.perf_counter()
        ph = self.last_phases = {}
        try:
            if paused_here:
                pause(self.server, self.pause_mode, timeout_s=max(1.0, deadline - time.monotonic()))
            ph["pause_s"] = time.perf_counter() - t0
            self.last_drain_s = ph["pause_s"] if paused_here and self.pause_mode == "wait" else 0.0
            left = max(1.0, deadline - time.monotonic())
            t1 = time.perf_counter()
            got = self._call("fastsync_flip" if self.staged else "fastsync_update", version, left, timeout_s=left + 10)
            ph["flip_s" if self.staged else "update_s"] = time.perf_counter() - t1
            ph["worker_flip_s"] = max(float(g.get("flip_s", 0.0)) for g in got) if self.staged else 0.0
            self.last_version = version
            return [{**g, "paused_by_fastsync": paused_here, "drain_s": self.last_drain_s} for g in got]
        finally:
            t1 = time.perf_counter()
            steps = version if self.global_steps is None else self.global_steps
            # caches of the old weights dropped, the weights labelled and recorded with verl, then
            # resumed if this call paused: one call on the engine loop; on a failed sync only the resume
            flipped = self.last_version == version
            if flipped or paused_here:
                after_flip(self.server, steps if flipped else None, paused_here)
            ph["after_s"] = time.perf_counter() - t1
            self.last_stall_s = max(0.0, time.perf_counter() - t0 - self.last_drain_s)

    def version(self) -> int:
        return one_version(self._call("fastsync_version"), f"verl vLLM server {self.engine_id}")

    def held(self) -> int:
        """The newest version any worker served or began (a failed one stays spent): a session's
        versions must start above it."""
        return max(int(v) for v in self._call("fastsync_held"))


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
    # verl's own rule (vLLMHttpServer.lora_as_adapter): a LoRA rank without lora.merge=True serves the
    # adapter in a vLLM LoRA slot, which verl loads itself; merged, the engine holds base names only
    lora = getattr(getattr(adapter, "model_config", None), "lora", None) or {}
    rank = int(lora.get("rank", 0) or 0) or int(getattr(adapter.model_config, "lora_rank", 0) or 0)
    if rank > 0 and not lora.get("merge", False):
        return False, f"LoRA adapter (rank {rank}, lora.merge=False): verl loads it into vLLM's LoRA slot itself", False, 0
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
def _serve_fastsync(original: Any) -> Any:
    async def update_weights(self: Any, weights: Any, global_steps: int | None = None,
                             wire_format: str = "named_tensors", **kwargs: Any) -> Any:
        run = getattr(weights, "fastsync_serve", None)
        if run is None:
            return await original(self, weights, global_steps=global_steps, wire_format=wire_format, **kwargs)

        async def fallback(tensors: Any) -> Any:
            return await original(self, tensors, global_steps=global_steps, wire_format=wire_format, **kwargs)

        return await run(self, fallback)

    return update_weights


def install() -> bool:
    """Wrap verl's vLLM ``ServerAdapter.update_weights`` (once per process) so fastsync's receive
    object is served in place; returns False where verl's vLLM adapter is not imported (SGLang,
    a stand-in adapter): then the receive object is consumed as verl's tensors (full-tensor path)."""
    import sys

    mod = sys.modules.get(SERVER_ADAPTER.rpartition(".")[0])
    cls = getattr(mod, "ServerAdapter", None) if mod is not None else None
    if cls is None:
        return False
    wrap_hook_point(cls, "update_weights", _serve_fastsync, who="fastsync_verl.server")
    return True
