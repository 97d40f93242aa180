"""OpenRLHF's ``RolloutRayActor`` with fastsync's receiving end.

:class:`FastSyncRolloutRayActor` is ``ray.remote`` over a subclass of OpenRLHF's own actor class
(``RolloutRayActor.__ray_actor_class__``): it starts the same ``vllm.AsyncLLMEngine`` with
``worker_extension_cls`` set to :data:`fastsync_openrlhf.rollout_worker.EXTENSION` (OpenRLHF's
``create_vllm_engines`` hard-codes its own ``WorkerWrap``; the subclass replaces that one value)
and forwards fastsync's calls to every worker through ``collective_rpc``, as OpenRLHF forwards its
own ``update_weight``. ``collective_rpc`` runs inside the engine-core loop, so no forward pass runs
while a version is written and flipped (fastsync's fence).

Imported by the driver (to rebind the name) and by the rollout Ray workers: nothing here imports
DeepSpeed.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import ray
from openrlhf.trainer.ray import vllm_engine

from fastsync_openrlhf.rollout_worker import EXTENSION

__all__ = ["FastSyncRolloutRayActor", "FastSyncRollout", "RolloutBase", "OPENRLHF_EXTENSION"]

log = logging.getLogger(__name__)

#: The worker extension OpenRLHF 0.11.2's ``create_vllm_engines`` passes.
OPENRLHF_EXTENSION = "openrlhf.trainer.ray.vllm_worker_wrap.WorkerWrap"

_base = vllm_engine.RolloutRayActor
RolloutBase: type = getattr(_base, "__ray_actor_class__", _base)  # the plain class, also after a rebinding


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
        return await self._rpc("fastsync_connect", plan_json, options)

    async def fastsync_update(self, version: int, timeout_s: float = 60.0) -> list:
        """Begin, wait for every write, post-process and flip, on every worker (one fenced call);
        a worker that fails answers ``{"error": ...}`` and keeps its previous version."""
        return await self._rpc("fastsync_update", version, timeout_s, timeout_s=timeout_s + 30.0)

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
