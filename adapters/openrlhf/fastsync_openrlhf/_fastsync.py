"""Every fastsync name this adapter uses, imported in one place, from fastsync's public API
(``fastsync.__all__``) and, for the vLLM worker side, from ``fastsync.engines.vllm`` (the
package ``worker_extension_cls`` strings name). Imports nothing heavy until a name is used."""

from __future__ import annotations

from typing import Any

from fastsync import (
    RpcEngine,
    node_address,
    share_over_torch,
    DEFAULT_HOST,
    ConfigError,
    FastSyncError,
    LayoutError,
    ParamSpec,
    SyncError,
    TCPStoreControl,
    TrainerLayout,
    WeightSync,
    patch_moe,
    one_version,
    replicated_layout,
    trainer_layout_from_spec,
    weight_spans,
)

__all__ = ["DEFAULT_HOST", "TCPStoreControl", "ConfigError", "FastSyncError", "LayoutError", "SyncError",
           "replicated_layout", "zero3_layout", "ParamSpec", "TrainerLayout", "WeightSync", "patch_moe",
           "worker_extension_class", "raise_worker_errors", "one_version", "RpcEngine",
           "node_address", "share_over_torch", "weight_spans"]


def zero3_layout(params: dict[str, ParamSpec], world_size: int) -> TrainerLayout:
    """DeepSpeed ZeRO-3's flat partitions of ``params`` over ``world_size`` ranks (``zero3:N``)."""
    return trainer_layout_from_spec(f"zero3:{int(world_size)}", params)


def worker_extension_class() -> type:
    """fastsync's vLLM worker extension (imports vLLM: call it in vLLM's processes only)."""
    from fastsync.engines.vllm import FastSyncWorkerExtension

    return FastSyncWorkerExtension


def raise_worker_errors(results: list, what: str) -> Any:
    """Re-raise the first ``{"error": [cls, msg]}`` a vLLM worker answered, as that fastsync error."""
    from fastsync.engines.vllm import raise_worker_errors as _raise

    return _raise(results, what)
