"""fastsync: all-to-all one-sided weight sync and MoE layer swaps for RL post-training.

Public API only. Heavy parts (torch.distributed, NIXL, vLLM) are imported by the modules that
need them, never here.
"""

from __future__ import annotations

from fastsync.errors import (
    ConfigError,
    FastSyncError,
    LayoutError,
    MoEPatchError,
    PlanError,
    PluginError,
    SyncError,
    TransportError,
)
from fastsync.hookspecs import hookimpl

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "hookimpl",
    "FastSyncError",
    "ConfigError",
    "LayoutError",
    "PlanError",
    "TransportError",
    "SyncError",
    "PluginError",
    "MoEPatchError",
]
