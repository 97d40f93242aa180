"""Every fastsync name this adapter uses, imported in one place, from fastsync's public API
(``fastsync.__all__``) and, for the vLLM worker side, from ``fastsync.engines.vllm`` (the
package ``worker_extension_cls`` strings name). Imports nothing heavy until a name is used."""

from __future__ import annotations

from fastsync import (
    FANOUTS,
    MOE_BACKENDS,
    ConfigError,
    LayoutError,
    ParamSpec,
    RpcEngine,
    Spelling,
    SyncError,
    TrainerLayout,
    WeightSync,
    check_sync_options,
    node_address,
    patch_moe,
    ray_result,
    replicated_layout,
    share_over_torch,
    trainer_layout_from_spec,
    weight_spans,
)

__all__ = ["ConfigError", "LayoutError", "SyncError", "ParamSpec", "WeightSync", "RpcEngine", "node_address",
           "share_over_torch", "ray_result", "replicated_layout", "zero3_layout", "patch_moe", "weight_spans",
           "FANOUTS", "MOE_BACKENDS", "Spelling", "check_sync_options", "worker_extension_class"]


def zero3_layout(params: dict[str, ParamSpec], world_size: int) -> TrainerLayout:
    """DeepSpeed ZeRO-3's flat partitions of ``params`` over ``world_size`` ranks (``zero3:N``)."""
    return trainer_layout_from_spec(f"zero3:{int(world_size)}", params)


def worker_extension_class() -> type:
    """fastsync's vLLM worker extension (imports vLLM: call it in vLLM's processes only)."""
    from fastsync.engines.vllm import FastSyncWorkerExtension

    return FastSyncWorkerExtension
