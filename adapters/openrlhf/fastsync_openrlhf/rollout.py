"""OpenRLHF's ``RolloutRayActor`` with fastsync's receiving end.

:class:`FastSyncRolloutRayActor` is ``ray.remote`` over a subclass of OpenRLHF's own actor class
(``RolloutRayActor.__ray_actor_class__``): it starts the same ``vllm.AsyncLLMEngine`` with
``worker_extension_cls`` set to :data:`fastsync_openrlhf.rollout_worker.EXTENSION` (OpenRLHF's
``create_vllm_engines`` hard-codes its own ``WorkerWrap``; the subclass replaces that one value)
and forwards fastsync's calls to every worker through ``collective_rpc``, inside the engine-core
loop (fastsync's fence). It labels the engine's weights with fastsync's version at connect and
every flip, and stamps OpenRLHF's samples with the versions that generated them (``weight_versions``,
``extra_logs`` ``weight_version_min/max``): ``adapters/openrlhf/README.md``.

Imported by the driver (to rebind the name) and by the rollout Ray workers: nothing here imports
DeepSpeed.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import os
import sys
import time
from typing import Any

import ray
from openrlhf.trainer.ray import vllm_engine

from fastsync_openrlhf._fastsync import weight_spans
from fastsync_openrlhf.rollout_worker import EXTENSION

__all__ = ["FastSyncRolloutRayActor", "FastSyncRollout", "RolloutBase", "OPENRLHF_EXTENSION"]

log = logging.getLogger(__name__)

#: The worker extension OpenRLHF 0.11.2's ``create_vllm_engines`` passes.
OPENRLHF_EXTENSION = "openrlhf.trainer.ray.vllm_worker_wrap.WorkerWrap"

_base = vllm_engine.RolloutRayActor
RolloutBase: type = getattr(_base, "__ray_actor_class__", _base)  # the plain class, also after a rebinding


#: inside one sample of ``generate_responses``: the spans of each ``generate`` call it made
_SAMPLE_SPANS: contextvars.ContextVar[list | None] = contextvars.ContextVar("fastsync_sample_spans", default=None)


def _failed(replies: list) -> bool:
    """Whether a worker answered ``{"error": ...}`` (it kept its previous version)."""
    return any(isinstance(g, dict) and "error" in g for g in replies)


def stamp_response(response: dict, calls: list[list[list]]) -> dict:
    """Add ``weight_versions`` (per generate call) and ``extra_logs`` ``weight_version_min/max``."""
    response["weight_versions"] = calls
    versions = [v for spans in calls for v, _ in spans if isinstance(v, int)]
    if versions and isinstance(response.get("extra_logs"), dict):
        response["extra_logs"].update(weight_version_min=min(versions), weight_version_max=max(versions))
    return response


class FastSyncRollout(RolloutBase):  # type: ignore[misc, valid-type]
    async def __init__(self, *args: Any, **kwargs: Any) -> None:
        ext = kwargs.get("worker_extension_cls")
        if ext not in (None, OPENRLHF_EXTENSION, EXTENSION):
            from fastsync_openrlhf._fastsync import ConfigError

            raise ConfigError(f"FastSyncRolloutRayActor: worker_extension_cls={ext!r} would replace OpenRLHF's "
                              f"WorkerWrap and fastsync's extension; expected {OPENRLHF_EXTENSION!r}")
        kwargs["worker_extension_cls"] = EXTENSION
        await super().__init__(*args, **kwargs)

    # ---- fastsync's calls, forwarded to every worker ---------------------------------------
    async def _rpc(self, method: str, *args: Any, timeout_s: float | None = None) -> list:
        return await self.llm.collective_rpc(method, timeout=timeout_s, args=args)

    async def fastsync_describe(self, options: dict | None = None) -> list:
        return await self._rpc("fastsync_describe", options or {})

    async def fastsync_connect(self, plan_json: str, options: dict) -> list:
        got = await self._rpc("fastsync_connect", plan_json, options)
        if not _failed(got):
            served = await self._rpc("fastsync_version")
            await self.llm.update_weight_version(str(served[0]))  # what every completion is stamped with
        return got

    async def fastsync_update(self, version: int, timeout_s: float = 60.0) -> list:
        """Begin, wait for every write, post-process and flip, on every worker (one fenced call);
        a worker that fails answers ``{"error": ...}`` and keeps its previous version. Then the
        label (module doc), inside a ``keep`` pause unless the engine was paused already."""
        paused_here = not await self.llm.is_paused()
        t0 = time.monotonic()
        if paused_here:  # requests stay in the engine, caches kept: only the label's step is held
            await self.llm.engine_core.pause_scheduler_async(mode="keep", clear_cache=False)
        try:
            got = await self._rpc("fastsync_update", version, timeout_s, timeout_s=timeout_s + 30.0)
            if not _failed(got):
                await self.llm.update_weight_version(str(version))
        finally:
            if paused_here:
                await self.llm.resume_generation()
        # the update runs inside the engine core (no step between its start and the flip): the
        # whole call is generation held back, the engine's stall for this sync
        stall = time.monotonic() - t0
        return [{**g, "stall_s": stall} if isinstance(g, dict) and "error" not in g else g for g in got]

    # ---- version stamps on OpenRLHF's samples ----------------------------------------------
    async def generate(self, prompt_token_ids: Any, sampling_params: Any, multi_modal_data: Any = None) -> Any:
        out = await super().generate(prompt_token_ids, sampling_params, multi_modal_data=multi_modal_data)
        calls = _SAMPLE_SPANS.get()
        if calls is not None:
            calls.append(weight_spans(out))
        return out

    async def generate_responses(self, prompt: str, label: str, sampling_params: Any, max_length: int,
                                 hf_tokenizer: Any, num_samples: int = 1, images: Any = None) -> list:
        """OpenRLHF's, one sample per task (each with its own record of spans), then stamped."""
        parent = super()

        async def one() -> dict:
            calls: list = []
            _SAMPLE_SPANS.set(calls)  # this task's own context
            [response] = await parent.generate_responses(prompt, label, sampling_params, max_length, hf_tokenizer,
                                                         num_samples=1, images=images)
            return stamp_response(response, calls)

        return list(await asyncio.gather(*(asyncio.create_task(one()) for _ in range(num_samples))))

    async def fastsync_version(self) -> list:
        return await self._rpc("fastsync_version")

    async def fastsync_close(self) -> list:
        return await self._rpc("fastsync_close")

    async def fastsync_openrlhf_report(self) -> dict:
        """This actor's class and process, and each vLLM worker's (checked by the tests there)."""
        workers = await self._rpc("fastsync_openrlhf_report")
        return {"pid": os.getpid(), "actor_mro": [f"{c.__module__}.{c.__qualname__}" for c in type(self).__mro__],
                "deepspeed_imported": "deepspeed" in sys.modules, "workers": workers}


#: What ``hooks.install`` binds as ``openrlhf.trainer.ray.vllm_engine.RolloutRayActor``.
FastSyncRolloutRayActor = ray.remote(FastSyncRollout)
