"""Every fastsync name this adapter uses, imported in one place (the core's module layout may
move; only this file follows it). Nothing here imports vLLM, DeepSpeed or OpenRLHF."""

from __future__ import annotations

from fastsync.control import DEFAULT_HOST, TCPStoreControl
from fastsync.errors import ConfigError, FastSyncError, LayoutError, SyncError
from fastsync.layout.trainer import replicated_layout, zero3_layout
from fastsync.layout.types import ParamSpec, TrainerLayout
from fastsync.sync import WeightSync

__all__ = ["DEFAULT_HOST", "TCPStoreControl", "ConfigError", "FastSyncError", "LayoutError", "SyncError",
           "replicated_layout", "zero3_layout", "ParamSpec", "TrainerLayout", "WeightSync",
           "worker_extension_class", "raise_worker_errors"]


def worker_extension_class() -> type:
    """fastsync's vLLM worker extension (imported lazily: it imports vLLM)."""
    from fastsync.engines.vllm import FastSyncWorkerExtension

    return FastSyncWorkerExtension


def raise_worker_errors(results: list, what: str) -> list:
    """Re-raise the first ``{"error": [cls, msg]}`` a vLLM worker answered, as that fastsync error."""
    from fastsync.engines.vllm_host import raise_worker_errors as _raise

    return _raise(results, what)
