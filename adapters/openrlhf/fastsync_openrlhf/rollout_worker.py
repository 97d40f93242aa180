"""The ``worker_extension_cls`` of OpenRLHF's vLLM engines under fastsync: OpenRLHF's own
``WorkerWrap`` (``init_process_group``, ``update_weight``, ``update_weight_cuda_ipc``: kept, so
``--train.colocate_all``'s CUDA-IPC path still works) and fastsync's vLLM worker extension
(``fastsync_describe/connect/begin/finish/update/version/close``) in one class. vLLM mixes it
into every worker of the engine. Imported in vLLM's processes: nothing here imports DeepSpeed
(``openrlhf.trainer.ray.vllm_worker_wrap`` has no top-level imports)."""

from __future__ import annotations

import os
import sys

from openrlhf.trainer.ray.vllm_worker_wrap import WorkerWrap

from fastsync_openrlhf._fastsync import worker_extension_class

__all__ = ["FastSyncWorkerWrap", "EXTENSION"]

#: The value ``FastSyncRolloutRayActor`` passes as ``worker_extension_cls``.
EXTENSION = "fastsync_openrlhf.rollout_worker.FastSyncWorkerWrap"


class FastSyncWorkerWrap(WorkerWrap, worker_extension_class()):  # type: ignore[misc]
    """OpenRLHF's WorkerWrap + fastsync's worker extension (method names do not overlap: fastsync's
    all start with ``fastsync_``)."""

    def fastsync_openrlhf_report(self) -> dict:
        """Where this worker runs and what it is made of (the adapter's tests check these inside
        the engine's own processes)."""
        return {"pid": os.getpid(), "mro": [f"{c.__module__}.{c.__qualname__}" for c in type(self).__mro__],
                "deepspeed_imported": "deepspeed" in sys.modules}
