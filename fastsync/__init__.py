"""fastsync: all-to-all one-sided weight sync and MoE layer swaps for RL post-training.

The public API: everything a host adapter (verl, OpenRLHF, a custom loop) needs is importable
from ``fastsync`` itself; other module paths are internal and may move. Heavy parts (torch,
torch.distributed, NIXL, vLLM) are imported lazily, on first use of a name that needs them, so
``import fastsync`` stays light (errors and the hook marker only).

* Sync lifecycle: ``WeightSync`` (trainer side, drives live engines), ``WeightSender`` (one
  trainer rank), ``WeightReceiver`` (one engine rank), ``SyncResult``, ``EngineHandle``;
  delta sync (only what changed): ``DeltaSender``, ``DeltaReceiver``.
* Control plane: ``TCPStoreControl``, ``ControlPlane``, ``DEFAULT_HOST``; the job secret:
  ``job_secret`` (resolve or create one), ``SECRET_ENV`` (its environment variable).
* Planning: ``build_plan``, ``Plan``, ``Transfer``, ``simulate``.
* Layouts: ``trainer_layout_from_spec`` / ``engine_layout_from_spec`` (spec strings such as
  ``fsdp:8``, ``vllm:tp8``), ``trainer_layout_from_module`` (a live DTensor / plain module),
  ``replicated_layout``, ``load_inventory`` / ``inventory_from_config``, ``get_name_map``, the
  layout records (``ParamSpec``, ``Shard``, ``Piece``, ``EngineTensor``, ``TrainerLayout``,
  ``EngineLayout``, ``Inventory``), engines' padded shapes (``DimPad``, ``pad_tensor``) and box
  helpers (``Box``, ``full_box``, ``box_shape``, ``box_slices``).
* Tensors: ``alloc_touched``, ``dtype_name``, ``torch_dtype``.
* MoE: ``patch_moe`` (swap HF v5 MoE blocks), ``RoutingReplay``.
* Engines: ``FastSyncWorkerExtension`` (vLLM's ``worker_extension_cls``, to subclass or compose);
  ``RemoteEngine`` / ``serve_engine`` (an engine handle answered over the control plane by a host
  that drives the engine, e.g. verl's rollout server), ``raise_worker_errors`` / ``worker_error_reply``, ``one_version`` (every worker on one weight version); vLLM's pause
  modes by name: ``PAUSE_MODES``, ``check_pause_mode``; ``weight_spans`` (which weight versions
  sampled a vLLM completion).
* Plugins: ``hookimpl``, ``register_plugin``, ``unregister_plugin``; errors: ``FastSyncError``
  and its subclasses.
"""

from __future__ import annotations

import importlib
from typing import Any

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

#: public name -> (module, attribute in that module); resolved on first access.
_LAZY: dict[str, tuple[str, str]] = {
    # sync lifecycle
    "WeightSync": ("fastsync.sync", "WeightSync"),  # through the package: its PEFT variant registers
    "SyncResult": ("fastsync.sync.engine_handle", "SyncResult"),
    "EngineHandle": ("fastsync.sync.engine_handle", "EngineHandle"),
    "WeightSender": ("fastsync.sync.sender", "WeightSender"),
    "WeightReceiver": ("fastsync.sync.receiver", "WeightReceiver"),
    "DeltaSender": ("fastsync.sync.delta_sender", "DeltaSender"),
    "DeltaReceiver": ("fastsync.sync.delta_receiver", "DeltaReceiver"),
    # control plane
    "ControlPlane": ("fastsync.control", "ControlPlane"),
    "TCPStoreControl": ("fastsync.control", "TCPStoreControl"),
    "DEFAULT_HOST": ("fastsync.control", "DEFAULT_HOST"),
    "job_secret": ("fastsync.security", "job_secret"),
    "SECRET_ENV": ("fastsync.security", "SECRET_ENV"),
    # planning
    "build_plan": ("fastsync.plan.planner", "build_plan"),
    # engines
    "FastSyncWorkerExtension": ("fastsync.engines.vllm.extension", "FastSyncWorkerExtension"),
    "RemoteEngine": ("fastsync.engines.vllm.remote", "RemoteEngine"),
    "serve_engine": ("fastsync.engines.vllm.remote", "serve"),
    "raise_worker_errors": ("fastsync.host.replies", "raise_worker_errors"),
    "worker_error_reply": ("fastsync.host.replies", "error_reply"),
    "one_version": ("fastsync.host.replies", "one_version"),
    "PAUSE_MODES": ("fastsync.sync.pause_modes", "PAUSE_MODES"),
    "check_pause_mode": ("fastsync.sync.pause_modes", "check_pause_mode"),
    "check_sync_options": ("fastsync.sync.sync_options", "check_sync_options"),
    "Spelling": ("fastsync.sync.sync_options", "Spelling"),
    "FANOUTS": ("fastsync.sync.sync_options", "FANOUTS"),
    "VERIFY_MODES": ("fastsync.executor.verify_mode", "VERIFY_MODES"),
    "verify_mode": ("fastsync.executor.verify_mode", "verify_mode"),
    "weight_spans": ("fastsync.engines.vllm.pause", "weight_spans"),
    # the host kit (fastsync.host)
    "open_control": ("fastsync.host.control", "open_control"),
    "control_address": ("fastsync.host.control", "control_address"),
    "join_control": ("fastsync.host.control", "join_control"),
    "share_over_torch": ("fastsync.host.control", "share_over_torch"),
    "node_address": ("fastsync.host.control", "node_address"),
    "RpcEngine": ("fastsync.host.rpc_engine", "RpcEngine"),
    "ray_result": ("fastsync.host.rpc_engine", "ray_result"),
    "FullCopySender": ("fastsync.host.fullcopy", "FullCopySender"),
    "FullCopyReceiver": ("fastsync.host.fullcopy", "FullCopyReceiver"),
    "shard_views": ("fastsync.host.fullcopy_plan", "shard_views"),
    "renamed_shard_layout": ("fastsync.host.local_shards", "renamed_shard_layout"),
    "copy_local_shards": ("fastsync.host.local_shards", "copy_local_shards"),
    "MasterState": ("fastsync.host.sessions", "MasterState"),
    "DeepSpeedWeightSync": ("fastsync.host.deepspeed_sync", "DeepSpeedWeightSync"),
    "HookPointError": ("fastsync.host.patching", "HookPointError"),
    "resolve_hook_point": ("fastsync.host.patching", "resolve"),
    "wrap_hook_point": ("fastsync.host.patching", "wrap"),
    "unwrap_hook_point": ("fastsync.host.patching", "unwrap"),
    "is_wrapped": ("fastsync.host.patching", "is_wrapped"),
    "store_request": ("fastsync.host.store_rpc", "store_request"),
    "store_replies": ("fastsync.host.store_rpc", "store_replies"),
    "answer_to_store": ("fastsync.host.store_rpc", "answer_to_store"),
    "session_meta": ("fastsync.host.sessions", "session_meta"),
    "assign_session": ("fastsync.host.sessions", "assign_session"),
    "new_member_id": ("fastsync.host.sessions", "new_member_id"),
    "PATH_POLICIES": ("fastsync.host.path_choice", "PATH_POLICIES"),
    "publish_capability": ("fastsync.host.path_choice", "publish_capability"),
    "decide_path": ("fastsync.host.path_choice", "decide_path"),
    "read_path": ("fastsync.host.path_choice", "read_path"),
    "Plan": ("fastsync.plan.types", "Plan"),
    "Transfer": ("fastsync.plan.types", "Transfer"),
    "simulate": ("fastsync.plan.simulate", "simulate"),
    # layouts
    "trainer_layout_from_spec": ("fastsync.layout.spec", "trainer_layout_from_spec"),
    "engine_layout_from_spec": ("fastsync.layout.spec", "engine_layout_from_spec"),
    "trainer_layout_from_module": ("fastsync.layout.dtensor", "trainer_layout_from_module"),
    "replicated_layout": ("fastsync.layout.trainer", "replicated_layout"),
    "local_sources": ("fastsync.sync.local_sources", "local_sources"),
    "lora_config_refusal": ("fastsync.host.lora_merge", "lora_config_refusal"),
    "lora_delta": ("fastsync.host.lora_merge", "lora_delta"),
    "zero3_sources": ("fastsync.layout.deepspeed", "zero3_sources"),
    "get_name_map": ("fastsync.layout.namemap", "get_name_map"),
    "ParamSpec": ("fastsync.layout.types", "ParamSpec"),
    "Shard": ("fastsync.layout.types", "Shard"),
    "Piece": ("fastsync.layout.types", "Piece"),
    "EngineTensor": ("fastsync.layout.types", "EngineTensor"),
    "TrainerLayout": ("fastsync.layout.types", "TrainerLayout"),
    "EngineLayout": ("fastsync.layout.types", "EngineLayout"),
    "DimPad": ("fastsync.layout.padding", "DimPad"),
    "pad_tensor": ("fastsync.layout.padding", "pad_tensor"),
    "Box": ("fastsync.layout.box", "Box"),
    "full_box": ("fastsync.layout.box", "full_box"),
    "box_shape": ("fastsync.layout.box", "box_shape"),
    "box_slices": ("fastsync.layout.box", "box_slices"),
    "Inventory": ("fastsync.models.inventory", "Inventory"),
    "load_inventory": ("fastsync.models.inventory", "load_inventory"),
    "inventory_from_config": ("fastsync.models.inventory", "inventory_from_config"),
    # tensors
    "alloc_touched": ("fastsync.executor.staging", "alloc_touched"),
    "dtype_name": ("fastsync.executor.staging", "dtype_name"),
    "torch_dtype": ("fastsync.executor.staging", "torch_dtype"),
    # MoE
    "patch_moe": ("fastsync.moe.patch", "patch"),
    "patch_moe_partitioned": ("fastsync.moe.partitioned", "patch_partitioned"),
    "MOE_BACKENDS": ("fastsync.moe.block", "BACKENDS"),
    "RoutingReplay": ("fastsync.moe.replay", "RoutingReplay"),
    # plugins
    "register_plugin": ("fastsync.plugins", "register_plugin"),
    "unregister_plugin": ("fastsync.plugins", "unregister_plugin"),
}

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
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    target = _LAZY.get(name)
    if target is None:
        raise AttributeError(f"module 'fastsync' has no attribute {name!r}")
    value = getattr(importlib.import_module(target[0]), target[1])
    globals()[name] = value  # resolve once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
