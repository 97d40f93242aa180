"""MoE layer swaps for HF transformers v5 models: grouped-GEMM experts, expert parallelism
(all-to-all over a torch.distributed group, DeepEP on GPU), TransformerEngine on GPU.

One switch: ``fastsync.moe.patch(model, ep_group=None, backend="auto")``.
"""

from __future__ import annotations

from fastsync.moe.experts import register_transformers_backend
from fastsync.moe.patch import ep_shards, expert_param_bytes, patch
from fastsync.moe.replay import RoutingReplay

__all__ = ["patch", "ep_shards", "expert_param_bytes", "RoutingReplay", "register_transformers_backend"]
