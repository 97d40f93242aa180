"""The host kit: what a host framework's adapter (verl, OpenRLHF, a user's own trainer) stands on,
so adapters stay glue. Framework-agnostic: nothing here imports verl, OpenRLHF or vLLM.

* ``control``: the job's control plane set up with the job secret (``open_control``,
  ``control_address``, ``join_control``, ``share_over_torch``; ``node_address`` for Ray nodes).
* ``rpc_engine``: ``RpcEngine``, one engine handle over any RPC (Ray actor call, ``collective_rpc``,
  HTTP) for ``WeightSync``; ``ray_result``, a Ray call awaited with a deadline.
* ``replies``: a worker's reply to and from the wire (``error_reply``, ``raise_worker_errors``,
  over ``fastsync.errors``' one codec) and
  ``one_version`` (every worker of an engine on one weight version).
* ``fullcopy`` / ``fullcopy_plan``: the buffered full-copy channel for the fallback path
  (``FullCopySender`` / ``FullCopyReceiver``) and its plan; ``flat_views``: a registered host
  buffer as typed per-tensor views (carved by ``fastsync.executor.arena``).
"""

from __future__ import annotations

from fastsync.host.control import control_address, join_control, node_address, open_control, share_over_torch
from fastsync.host.fullcopy import FullCopyReceiver, FullCopySender
from fastsync.host.fullcopy_plan import FullCopyPlan, build_full_copy_plan, flat_views
from fastsync.host.replies import error_reply, one_version, raise_worker_errors
from fastsync.host.rpc_engine import RpcEngine, ray_result

__all__ = ["node_address", "open_control", "control_address", "join_control", "share_over_torch", "RpcEngine",
           "ray_result",
           "error_reply", "raise_worker_errors", "one_version", "FullCopySender", "FullCopyReceiver", "FullCopyPlan",
           "build_full_copy_plan", "flat_views"]
