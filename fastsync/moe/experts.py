"""Expert MLPs computed as grouped GEMMs over tokens sorted by expert.

Why: HF v5's "eager" experts loop over experts with a one-hot mask per expert, and its
"grouped_mm" path calls ``torch.nn.functional.grouped_mm``, whose CPU kernel is slow. Here the
token-expert pairs are sorted by expert once, each expert's rows form one contiguous segment, and
each projection is one grouped GEMM over those segments:

- ``"grouped_mm"``: ``torch.nn.functional.grouped_mm`` / ``torch._grouped_mm`` with its own
  autograd: one kernel per projection, no host sync on segment sizes. The default wherever it
  takes the weights (16-byte row strides; SM80+ on CUDA): on this project's CPU it measured as
  fast as or faster than the loop below.
- ``"torch"``: one BLAS ``mm`` per non-empty segment, forward and backward (a hand-written
  autograd Function: backward is two ``mm`` per segment and nothing else). Runs anywhere.

What fastsync adds around the GEMMs: one stable sort, the SiLU-gated product fused in one
autograd node (``_SwiGLU``), routing weights applied and rows summed with one ``index_add``.

The expert weights keep HF's layout: ``gate_up_proj`` (E, 2I, H) and ``down_proj`` (E, H, I), or
transposed (E, H, 2I) / (E, I, H) with biases for GPT-OSS. The gate activation is the HF experts
class's own ``_apply_gate`` (concatenated SwiGLU, GPT-OSS's interleaved clamped SwiGLU), so the
maths is HF's by construction.

``fastsync_experts_forward`` has HF's experts-function signature and is registered in
transformers' ``ExpertsInterface`` as ``"fastsync"`` (``model.set_experts_implementation("fastsync")``
gives the single-process path without ``fastsync.moe.patch``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from fastsync.errors import MoEPatchError

__all__ = [
    "EXPERT_BACKENDS",
    "grouped_mm_available",
    "grouped_linear",
    "expert_mlp",
    "sort_by_expert",
    "combine_sorted",
    "local_experts_forward",
    "fastsync_experts_forward",
    "register_transformers_backend",
]

#: the kernels an experts module can run; "auto" resolves to one of these at patch time
EXPERT_BACKENDS = ("torch", "grouped_mm")


def grouped_mm_available() -> bool:
    """Whether this torch has a grouped GEMM op (``F.grouped_mm`` or ``torch._grouped_mm``)."""
    return hasattr(F, "grouped_mm") or hasattr(torch, "_grouped_mm")


class _SegmentMM(torch.autograd.Function):
    """y[seg e] = x[seg e] @ W_e, with W_e = w[e] if ``transposed`` else w[e].T.

    ``counts`` are the segment lengths (a host list: one sync per projection, paid once in the
    caller). Backward: dx = dy @ W_e.T, dW_e = x.T @ dy (or its transpose), one ``mm`` each.
    """

    @staticmethod
    def forward(ctx: Any, x_SI: torch.Tensor, w: torch.Tensor, counts: list[int], transposed: bool) -> torch.Tensor:
        out_dim = w.shape[2] if transposed else w.shape[1]
        y_SO = x_SI.new_empty(x_SI.shape[0], out_dim)
        start = 0
        for e, n in enumerate(counts):
            if n:
                w_e = w[e] if transposed else w[e].t()
                torch.mm(x_SI[start : start + n], w_e, out=y_SO[start : start + n])
            start += n
        ctx.save_for_backward(x_SI, w)
        ctx.counts = counts
        ctx.transposed = transposed
        return y_SO

    @staticmethod
    def backward(ctx: Any, dy_SO: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        x_SI, w = ctx.saved_tensors
        dy_SO = dy_SO.contiguous()
        need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dx = torch.empty_like(x_SI) if need_x else None
        dw = torch.empty_like(w) if need_w else None  # every expert's slice is written below
        start = 0
        for e, n in enumerate(ctx.counts):
            rows = slice(start, start + n)
            start += n
            if not n:
                if dw is not None:
                    dw[e].zero_()  # an expert no row chose
                continue
            if ctx.transposed:  # W_e = w[e], (I, O)
                if dx is not None:
                    torch.mm(dy_SO[rows], w[e].t(), out=dx[rows])
                if dw is not None:
                    torch.mm(x_SI[rows].t(), dy_SO[rows], out=dw[e])
            else:  # W_e = w[e].T, w[e] is (O, I)
                if dx is not None:
                    torch.mm(dy_SO[rows], w[e], out=dx[rows])
                if dw is not None:
                    torch.mm(dy_SO[rows].t(), x_SI[rows], out=dw[e])
        return dx, dw, None, None


class _SwiGLU(torch.autograd.Function):
    """silu(gate) * up over the concatenated [gate | up] halves, HF's default ``_apply_gate``
    with SiLU, in one pass each way: backward writes both halves' gradients into one buffer
    (autograd's version would also build the halves separately and concatenate them)."""

    @staticmethod
    def forward(ctx: Any, h_S2I: torch.Tensor) -> torch.Tensor:
        gate, up = h_S2I.chunk(2, dim=-1)
        ctx.save_for_backward(h_S2I)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx: Any, da_SI: torch.Tensor) -> torch.Tensor:
        (h_S2I,) = ctx.saved_tensors
        gate, up = h_S2I.chunk(2, dim=-1)
        dh = torch.empty_like(h_S2I)
        d_gate, d_up = dh.chunk(2, dim=-1)
        sig = torch.sigmoid(gate)
        silu = gate * sig
        torch.mul(da_SI, silu, out=d_up)
        # d silu(g)/dg = sig + silu * (1 - sig), built in place to keep temporaries few
        silu.mul_(torch.sub(1, sig)).add_(sig)
        torch.mul(da_SI, up, out=d_gate)
        d_gate.mul_(silu)
        return dh


class _WeightedCombine(torch.autograd.Function):
    """out[t] = sum of w_S[s] * y_SH[s] over the rows s of token t (``index_add``).

    Backward without (S, H) temporaries beyond the one it must return: the incoming gradient is
    gathered once and scaled in place for dy; dw is a row-wise dot product (``bmm``)."""

    @staticmethod
    def forward(ctx: Any, y_SH: torch.Tensor, w_S: torch.Tensor, token: torch.Tensor, num_tokens: int) -> torch.Tensor:
        dtype = torch.promote_types(y_SH.dtype, w_S.dtype)
        weighted = y_SH.to(dtype) * w_S.to(dtype).unsqueeze(-1)
        out = weighted.new_zeros(num_tokens, y_SH.shape[-1]).index_add_(0, token, weighted)
        ctx.save_for_backward(y_SH, w_S, token)
        return out

    @staticmethod
    def backward(ctx: Any, d_out: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None, None]:
        y_SH, w_S, token = ctx.saved_tensors
        g_SH = d_out.index_select(0, token)
        dw = None
        if ctx.needs_input_grad[1]:
            dw = torch.bmm(g_SH.unsqueeze(1), y_SH.to(g_SH.dtype).unsqueeze(2)).view(-1).to(w_S.dtype)
        dy = g_SH.mul_(w_S.to(g_SH.dtype).unsqueeze(-1)).to(y_SH.dtype) if ctx.needs_input_grad[0] else None
        return dy, dw, None, None


def uses_default_swiglu(experts: torch.nn.Module) -> bool:
    from transformers.integrations.moe import _default_apply_gate

    gate_fn = getattr(experts, "hf_apply_gate", None) or getattr(type(experts), "_apply_gate", None)
    act = getattr(experts, "act_fn", None)
    return gate_fn is _default_apply_gate and type(act).__name__ == "SiLUActivation"


def _torch_grouped_mm(x_SI: torch.Tensor, w_EIO: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    if hasattr(F, "grouped_mm"):
        return F.grouped_mm(x_SI, w_EIO, offs=offs)
    return torch._grouped_mm(x_SI, w_EIO, offs=offs)


def grouped_linear(
    x_SI: torch.Tensor,
    w: torch.Tensor,
    counts_E: torch.Tensor,
    counts: list[int] | None,
    *,
    transposed: bool,
    backend: str,
    bias_EO: torch.Tensor | None = None,
) -> torch.Tensor:
    """One projection over expert-sorted rows; ``counts_E`` (tensor) / ``counts`` (host list)
    are the rows per expert. ``bias_EO`` is added per row (GPT-OSS)."""
    x_SI = x_SI.to(w.dtype)
    if backend == "grouped_mm" and x_SI.shape[0] > 0:  # (an EP rank may receive no rows at all)
        offs = torch.cumsum(counts_E, dim=0, dtype=torch.int32)
        y = _torch_grouped_mm(x_SI, w if transposed else w.transpose(-2, -1), offs)
    else:
        counts = counts_E.tolist() if counts is None else counts
        y = _SegmentMM.apply(x_SI, w, counts, transposed)
    if bias_EO is not None:
        y = y + torch.repeat_interleave(bias_EO, counts_E, dim=0, output_size=x_SI.shape[0])
    return y


def expert_mlp(
    experts: torch.nn.Module,
    x_SH: torch.Tensor,
    counts_E: torch.Tensor,
    *,
    backend: str,
    gate_up_proj: torch.Tensor | None = None,
    down_proj: torch.Tensor | None = None,
    gate_up_proj_bias: torch.Tensor | None = None,
    down_proj_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The expert MLP on rows already sorted by (local) expert, ``counts_E`` rows per expert.

    Weights default to the module's own (``experts.gate_up_proj`` ...); the activation is
    ``experts._apply_gate`` (set by HF's ``use_experts_implementation`` or the class itself).
    """
    w1 = experts.gate_up_proj if gate_up_proj is None else gate_up_proj
    w2 = experts.down_proj if down_proj is None else down_proj
    has_bias = bool(getattr(experts, "has_bias", False))
    b1 = (experts.gate_up_proj_bias if gate_up_proj_bias is None else gate_up_proj_bias) if has_bias else None
    b2 = (experts.down_proj_bias if down_proj_bias is None else down_proj_bias) if has_bias else None
    transposed = bool(getattr(experts, "is_transposed", False))
    counts = counts_E.tolist() if backend != "grouped_mm" else None
    h = grouped_linear(x_SH, w1, counts_E, counts, transposed=transposed, backend=backend, bias_EO=b1)
    fused = getattr(experts, "fused_swiglu", None)
    if fused is None:
        fused = uses_default_swiglu(experts)
    a = _SwiGLU.apply(h) if fused else experts._apply_gate(h)
    return grouped_linear(a, w2, counts_E, counts, transposed=transposed, backend=backend, bias_EO=b2)


def sort_by_expert(top_k_index: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order, token_of_row, counts_E): the flat token-expert pairs sorted by expert (stable),
    the token each sorted row came from, and rows per expert. Indices >= num_experts (EP
    sentinels) are not expected here."""
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts_E = torch.bincount(flat, minlength=num_experts)
    token = torch.div(order, top_k_index.shape[-1], rounding_mode="floor")
    return order, token, counts_E


def combine_sorted(
    y_SH: torch.Tensor, order: torch.Tensor, token: torch.Tensor, top_k_weights: torch.Tensor, num_tokens: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """Weight each expert output by its routing weight and sum the top-k rows of each token.
    Accumulates in the promoted dtype (fp32 when the router weights are fp32), like HF."""
    w_S = top_k_weights.reshape(-1).index_select(0, order)
    return _WeightedCombine.apply(y_SH, w_S, token, num_tokens).to(out_dtype)


def local_experts_forward(
    experts: torch.nn.Module,
    hidden_states: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    *,
    backend: str,
) -> torch.Tensor:
    """All experts in this process: sort, one grouped GEMM per projection, weighted sum."""
    order, token, counts_E = sort_by_expert(top_k_index, experts.num_experts)
    x_SH = hidden_states.index_select(0, token)
    y_SH = expert_mlp(experts, x_SH, counts_E, backend=backend)
    return combine_sorted(y_SH, order, token, top_k_weights, hidden_states.shape[0], hidden_states.dtype)


def grouped_mm_fits(experts: torch.nn.Module) -> str | None:
    """None when torch's grouped GEMM takes these expert weights here, else why not: it needs
    row strides that are multiples of 16 bytes (CPU and CUDA), and SM80+ on CUDA."""
    if not grouped_mm_available():
        return "this torch has no F.grouped_mm / torch._grouped_mm"
    w = experts.gate_up_proj
    per16 = 16 // w.element_size()
    dims = {"gate_up_proj": tuple(w.shape[1:]), "down_proj": tuple(experts.down_proj.shape[1:])}
    if any(d % per16 for shape in dims.values() for d in shape):
        return f"expert weight dims {dims} are not multiples of {per16} ({w.dtype}: 16-byte strides)"
    if w.device.type == "cuda" and torch.cuda.get_device_capability(w.device) < (8, 0):
        return "torch grouped_mm needs an SM80+ GPU"
    return None


def default_backend(experts: torch.nn.Module) -> str:
    """``"grouped_mm"`` wherever torch's grouped GEMM takes the weights (it measured fastest on
    CPU too, see ``fastsync moe-bench``), else the per-segment ``mm`` loop."""
    return "grouped_mm" if grouped_mm_fits(experts) is None else "torch"


def fastsync_experts_forward(
    self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """HF ``ExpertsInterface`` entry (``experts_implementation="fastsync"``): single process."""
    if getattr(self, "_is_expert_parallel", False):
        raise MoEPatchError(
            f"{type(self).__name__}: experts_implementation='fastsync' does not handle transformers' own expert parallelism; "
            "use fastsync.moe.patch(model, ep_group=...)"
        )
    return local_experts_forward(
        self, hidden_states, top_k_index, top_k_weights, backend=default_backend(self)
    )


def register_transformers_backend(name: str = "fastsync") -> Callable[..., torch.Tensor]:
    """Register ``fastsync_experts_forward`` in transformers' ``ExpertsInterface`` (idempotent)."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(name, fastsync_experts_forward)
    return fastsync_experts_forward
