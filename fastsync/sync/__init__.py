"""The sync lifecycle: trainer side (``WeightSync``, ``WeightSender``), engine side
(``WeightReceiver``), the gather of trainer shards, and the handshake (control-plane keys and
the version rule) both sides share.

Names are exported lazily: importing ``fastsync.sync.handshake`` does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "WeightSync": "weight_sync",
    "EngineHandle": "engine_handle",
    "SyncResult": "engine_handle",
    "local_sources": "local_sources",
    "PeftWeightSync": "peft_sync",
    "PeftSyncResult": "peft_sync",
    "WeightSender": "sender",
    "WeightReceiver": "receiver",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    sub = _EXPORTS.get(name)
    if sub is None:
        raise AttributeError(f"module 'fastsync.sync' has no attribute {name!r}")
    if name == "WeightSync":  # its PEFT variant registers itself (WeightSync(peft_model) -> PeftWeightSync)
        from fastsync.sync import peft_sync  # noqa: F401
    return getattr(importlib.import_module(f"{__name__}.{sub}"), name)
