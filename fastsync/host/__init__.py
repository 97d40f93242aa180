"""The host kit: what a host framework's adapter (verl, OpenRLHF, a user's own trainer) stands on,
so adapters stay glue. Framework-agnostic: nothing here imports verl, OpenRLHF or vLLM.

* ``control``: the job's control plane set up with the job secret (``open_control``,
  ``control_address``, ``join_control``, ``share_over_torch``; ``node_address`` for Ray nodes).
* ``rpc_engine``: ``RpcEngine``, one engine handle over any RPC (Ray actor call, ``collective_rpc``,
  HTTP) for ``WeightSync``; ``ray_result``, a Ray call awaited with a deadline.
* ``replies``: a worker's reply to and from the wire (``error_reply``, ``raise_worker_errors``,
  over ``fastsync.errors``' one codec) and
  ``one_version`` (every worker of an engine on one weight version).
* ``sessions``: sessions and versions handed out by one master rank, for a host that rebuilds its
  sync group before every sync and may change its members (``MasterState``, ``session_meta``, ``assign_session``).
* ``path_choice``: in place or full copy, decided once per session by trainer rank 0
  (``publish_capability``, ``decide_path``, ``read_path``).
* ``deepspeed_sync``: ``DeepSpeedWeightSync``, the trainer side for a DeepSpeed job (every rank writes
  its ZeRO partitions; re-registered when DeepSpeed moved one). A PEFT LoRA module goes merged
  (``lora_merge``: ``MergedLoraSources``, each rank merging the adapters into its own slices).
* ``local_shards``: a trainer rank's FSDP2 shards under the host's names, copied into registered
  views before every sync (``renamed_shard_layout``, ``copy_local_shards``).
* ``patching``: a host's hook points found by name and wrapped once (``resolve``, ``wrap``,
  ``unwrap``, ``HookPointError`` naming the supported versions).
* ``store_rpc``: calls whose replies come back through the control store, for a host RPC that
  drops return values (``store_request``, ``store_replies``, ``answer_to_store``).
* ``fullcopy`` / ``fullcopy_plan``: the buffered full-copy channel for the fallback path
  (``FullCopySender`` / ``FullCopyReceiver``) and its plan; ``flat_views``: a registered host
  buffer as typed per-tensor views (carved by ``fastsync.executor.arena``).
"""

from __future__ import annotations

from fastsync.host.control import control_address, join_control, node_address, open_control, share_over_torch
from fastsync.host.deepspeed_sync import DeepSpeedWeightSync
from fastsync.host.fullcopy import FullCopyReceiver, FullCopySender
from fastsync.host.fullcopy_plan import FullCopyPlan, build_full_copy_plan, flat_views
from fastsync.host.local_shards import copy_local_shards, local_shard, renamed_shard_layout
from fastsync.host.patching import HookPointError, is_wrapped, resolve, unwrap, wrap
from fastsync.host.path_choice import MODE_KEY, PATH_POLICIES, decide_path, publish_capability, read_path
from fastsync.host.replies import error_reply, one_version, raise_worker_errors
from fastsync.host.rpc_engine import RpcEngine, ray_result
from fastsync.host.sessions import CONTROL_KEY, ID_KEY, JOINED_KEY, MASTER_KEY, Assignment, MasterState, assign_session
from fastsync.host.sessions import new_member_id, session_meta
from fastsync.host.store_rpc import answer_to_store, store_replies, store_request

__all__ = ["node_address", "open_control", "control_address", "join_control", "share_over_torch", "RpcEngine",
           "ray_result", "error_reply", "raise_worker_errors", "one_version", "FullCopySender", "FullCopyReceiver",
           "FullCopyPlan", "build_full_copy_plan", "flat_views", "MODE_KEY", "PATH_POLICIES", "decide_path",
           "publish_capability", "read_path", "CONTROL_KEY", "ID_KEY", "JOINED_KEY", "MASTER_KEY", "Assignment",
           "MasterState", "assign_session", "new_member_id", "session_meta", "store_request", "store_replies",
           "answer_to_store", "HookPointError", "resolve", "wrap", "unwrap", "is_wrapped", "local_shard",
           "renamed_shard_layout", "copy_local_shards", "DeepSpeedWeightSync"]
