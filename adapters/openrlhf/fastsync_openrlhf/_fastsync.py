"""Every fastsync name this adapter uses, imported in one place, from fastsync's public API
(``fastsync.__all__``) and, for the vLLM worker side, from ``fastsync.engines.vllm`` (the
package ``worker_extension_cls`` strings name). Imports nothing heavy until a name is used."""

from __future__ import annotations

from fastsync import (
    FANOUTS,
    MOE_BACKENDS,
    ConfigError,
    DeepSpeedWeightSync,
    HookPointError,
    RpcEngine,
    VERIFY_MODES,
    Spelling,
    check_sync_options,
    node_address,
    patch_moe_partitioned,
    ray_result,
    resolve_hook_point,
    verify_mode,
    weight_spans,
)

__all__ = ["ConfigError", "DeepSpeedWeightSync", "HookPointError", "RpcEngine", "node_address", "ray_result",
           "resolve_hook_point", "patch_moe_partitioned", "weight_spans", "FANOUTS", "MOE_BACKENDS", "Spelling",
           "check_sync_options", "VERIFY_MODES", "verify_mode", "worker_extension_class"]


def worker_extension_class() -> type:
    """fastsync's vLLM worker extension (imports vLLM: call it in vLLM's processes only)."""
    from fastsync.engines.vllm import FastSyncWorkerExtension

    return FastSyncWorkerExtension
