"""vLLM: everything fastsync knows about one engine, in one package.

* ``names``: the name maps (HF parameter -> vLLM fused tensors) for the built-in architectures.
* ``layout``: read a live vLLM model's parameters and check them against the name map.
* ``extension``: ``FastSyncWorkerExtension`` (``worker_extension_cls``) — describe, connect,
  begin/finish/update, version, inside every vLLM worker.
* ``handle``: ``VllmEngine`` (in-process ``LLM``); ``remote``: ``RemoteEngine`` + ``serve`` (another
  process, over the control plane) — the handles ``fastsync.WeightSync`` drives.
* ``backend`` / ``weight_transfer`` / ``weight_transfer_trainer``: fastsync as a backend of vLLM's
  own weight-transfer API (``--weight-transfer-config '{"backend": "fastsync"}'``), worker and
  trainer side, registered through the ``vllm.general_plugins`` entry point.

The core reaches this package only through hooks (``fastsync_name_map`` with ``engine="vllm"``,
``fastsync_architectures``), registered in ``fastsync._builtin``. Names are exported lazily so
that ``worker_extension_cls="fastsync.engines.vllm.FastSyncWorkerExtension"`` and the
``vllm.general_plugins`` entry point keep working without importing torch or vLLM here.
"""

from __future__ import annotations

import importlib
from typing import Any

ENGINE = "vllm"

_EXPORTS = {
    "FastSyncWorkerExtension": "extension",
    "EngineLanding": "worker_state",
    "EXTENSION": "extension",
    "ensure_amx_permission": "extension",
    "VllmEngine": "handle",
    "RemoteEngine": "remote",
    "serve": "remote",
    "register_weight_transfer": "backend",
    "tune_reader_spin": "spin",
    "fork_workers": "worker_start",
}

__all__ = ["ENGINE", *_EXPORTS]


def __getattr__(name: str) -> Any:
    sub = _EXPORTS.get(name)
    if sub is None:
        raise AttributeError(f"module 'fastsync.engines.vllm' has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{sub}"), name)
