"""Expert parallelism: send each token-expert pair to the rank owning the expert, compute, send back.

Experts are sharded contiguously: EP rank ``r`` of ``ep_size`` owns global experts
``[r * E/ep_size, (r + 1) * E/ep_size)``. Each rank routes its own tokens (the router and any
shared experts are replicated, data parallel), then, in order:

1. sort its token-expert pairs by global expert: rows bound for rank ``j`` are one contiguous run;
2. exchange per-expert counts (one small ``all_to_all_single``), so every rank knows its splits;
3. ``all_to_all_single`` the rows (differentiable: backward is the reverse all-to-all);
4. regroup the received rows (source-major) by local expert and run the grouped GEMMs;
5. undo the regrouping, reverse all-to-all, weight by the router's weights *at the source*
   (so router gradients stay local) and sum each token's top-k rows.

Works over any torch.distributed group: gloo on CPU, NCCL on GPU. ``DeepEPDispatcher`` uses
DeepEP's fused dispatch/combine kernels instead, on GPU, when ``deep_ep`` imports.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from fastsync.errors import MoEPatchError
from fastsync.moe.experts import combine_sorted, expert_mlp, sort_by_expert

__all__ = ["ep_experts_forward", "deep_ep_import_error", "DeepEPDispatcher", "AllToAll"]


class AllToAll(torch.autograd.Function):
    """``dist.all_to_all_single`` with uneven splits; backward is the reverse exchange."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any) -> torch.Tensor:
        out = x.new_empty(sum(out_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return out

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        out_splits, in_splits = ctx.splits
        dx = dy.new_empty(sum(in_splits), *dy.shape[1:])
        dist.all_to_all_single(dx, dy.contiguous(), in_splits, out_splits, group=ctx.group)
        return dx, None, None, None


def ep_experts_forward(
    experts: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    *,
    group: dist.ProcessGroup,
    backend: str,
) -> torch.Tensor:
    """Expert-parallel forward of one experts module whose parameters hold this rank's shard.

    ``experts.num_experts`` is the global count, ``experts.num_local_experts`` this rank's.
    Every rank of ``group`` must call this the same number of times (it is collective).
    """
    ep_size = dist.get_world_size(group)
    num_local = experts.num_local_experts
    num_tokens = hidden_states.shape[0]
    order, token, counts_E = sort_by_expert(top_k_index, experts.num_experts)

    # 2. who sends me how many rows for each of my experts: recv_counts[src, local_expert]
    counts_E = counts_E.to(torch.int64)
    recv_counts = torch.empty_like(counts_E)
    dist.all_to_all_single(recv_counts, counts_E, group=group)
    recv_counts = recv_counts.view(ep_size, num_local)
    send_splits = counts_E.view(ep_size, num_local).sum(1).tolist()
    recv_splits = recv_counts.sum(1).tolist()

    # 3. rows out, sorted by global expert = grouped by destination rank
    x_SH = hidden_states.index_select(0, token).contiguous()
    x_RH = AllToAll.apply(x_SH, recv_splits, send_splits, group)

    # 4. source-major -> local-expert-major
    seg_expert = torch.arange(num_local, device=x_RH.device).repeat(ep_size)
    row_expert = torch.repeat_interleave(seg_expert, recv_counts.reshape(-1).to(x_RH.device))
    regroup = torch.argsort(row_expert, stable=True)
    y_RH = expert_mlp(experts, x_RH.index_select(0, regroup), recv_counts.sum(0), backend=backend)
    undo = torch.empty_like(regroup)
    undo[regroup] = torch.arange(regroup.numel(), device=regroup.device)
    y_RH = y_RH.index_select(0, undo).contiguous()

    # 5. rows back to their tokens' rank, weighted and summed there
    y_SH = AllToAll.apply(y_RH, send_splits, recv_splits, group)
    return combine_sorted(y_SH, order, token, top_k_weights, num_tokens, hidden_states.dtype)


def deep_ep_import_error() -> str | None:
    """None when DeepEP can run here, else why not (what to install / what is missing)."""
    try:
        import deep_ep  # noqa: F401
    except ImportError as e:
        return f"deep_ep is not importable ({e}); install DeepEP (https://github.com/deepseek-ai/DeepEP) on a GPU host"
    if not torch.cuda.is_available():
        return "deep_ep imports but CUDA is not available; DeepEP dispatch/combine needs GPUs"
    return None


class DeepEPDispatcher:
    """DeepEP normal-mode (high-throughput) dispatch/combine for one EP group, GPU only.

    Follows DeepEP's training example: ``get_dispatch_layout`` -> ``dispatch`` (each token sent
    once per destination rank, with its local top-k ids, -1 where another rank owns the expert)
    -> local grouped GEMM -> ``combine`` (sums the per-rank partial outputs). Backward of dispatch
    is combine with the same handle, and vice versa. Not exercised on this project's CPU machines.
    """

    def __init__(self, group: dist.ProcessGroup, hidden_bytes: int) -> None:
        from deep_ep import Buffer

        cfg_d = Buffer.get_dispatch_config(group.size())
        cfg_c = Buffer.get_combine_config(group.size())
        num_nvl_bytes = max(
            cfg_d.get_nvl_buffer_size_hint(hidden_bytes, group.size()),
            cfg_c.get_nvl_buffer_size_hint(hidden_bytes, group.size()),
        )
        self.buffer = Buffer(group, num_nvl_bytes, 0)
        self.group = group

    def forward(
        self, experts: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor, *, backend: str,
    ) -> torch.Tensor:
        recv_x, recv_idx, recv_w, handle = _DeepEPDispatch.apply(
            self.buffer, hidden_states, top_k_index.to(torch.int64), top_k_weights.float(), experts.num_experts
        )
        # expand received tokens to (token, local expert) pairs; -1 marks experts elsewhere
        valid = recv_idx >= 0
        tok, slot = valid.nonzero(as_tuple=True)
        local_e = recv_idx[tok, slot]
        order = torch.argsort(local_e, stable=True)
        tok, slot, local_e = tok[order], slot[order], local_e[order]
        counts_E = torch.bincount(local_e, minlength=experts.num_local_experts)
        y = expert_mlp(experts, recv_x.index_select(0, tok), counts_E, backend=backend)
        y = y * recv_w[tok, slot].unsqueeze(-1).to(y.dtype)
        partial = y.new_zeros(recv_x.shape[0], y.shape[1]).index_add(0, tok, y)
        return _DeepEPCombine.apply(self.buffer, partial.to(hidden_states.dtype), handle)


class _DeepEPDispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, buffer: Any, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, num_experts: int):
        n_rank, n_rdma, n_expert, in_rank, _ = buffer.get_dispatch_layout(idx, num_experts)
        recv_x, recv_idx, recv_w, _, handle, _ = buffer.dispatch(
            x, topk_idx=idx, topk_weights=w, num_tokens_per_rank=n_rank, num_tokens_per_rdma_rank=n_rdma,
            is_token_in_rank=in_rank, num_tokens_per_expert=n_expert,
        )
        ctx.buffer, ctx.handle = buffer, handle
        ctx.mark_non_differentiable(recv_idx)
        return recv_x, recv_idx, recv_w, handle

    @staticmethod
    def backward(ctx: Any, d_recv_x: torch.Tensor, _d_idx: Any, d_recv_w: torch.Tensor, _d_handle: Any):
        dx, dw, _ = ctx.buffer.combine(d_recv_x.contiguous(), ctx.handle, topk_weights=d_recv_w.contiguous())
        return None, dx, None, dw, None


class _DeepEPCombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, buffer: Any, y: torch.Tensor, handle: Any) -> torch.Tensor:
        out, _, _ = buffer.combine(y.contiguous(), handle)
        ctx.buffer, ctx.handle = buffer, handle
        return out

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor):
        d_y, _, _, _, _, _ = ctx.buffer.dispatch(d_out.contiguous(), handle=ctx.handle)
        return None, d_y, None


def require_deep_ep(ep_group: Any) -> None:
    """Refuse ``backend="deepep"`` at patch time where it cannot run."""
    why = deep_ep_import_error()
    if why is not None:
        raise MoEPatchError(f"backend='deepep' requested but {why}")
    if ep_group is None:
        raise MoEPatchError("backend='deepep' needs an expert-parallel process group (ep_group=...)")
