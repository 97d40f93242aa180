"""The drop-in MoE block: HF's router and shared experts, fastsync's routed experts.

What is kept from the HF block, untouched: the router module (``gate`` / ``router``), so its
exact semantics (softmax vs sigmoid, top-k normalisation, DeepSeek-V3 group-limited routing with
``e_score_correction_bias``, GPT-OSS's biased logits) and the ``router_logits`` that HF's
``OutputRecorder`` captures for the aux loss are HF's own; shared experts (Qwen2-MoE's
``shared_expert`` + sigmoid ``shared_expert_gate``, DeepSeek-V3's ``shared_experts``); every plain
attribute. What changes: ``experts`` becomes a ``FastExperts`` holding the same parameters under the
same names (a shard of them under expert parallelism, gathered back to the full HF shape in
``state_dict()``), computed by grouped GEMM and, with an EP group, all-to-all dispatch.

The replacement is an instance of a subclass of the HF block class, so ``isinstance`` checks
(FSDP wrap policies, output recorders) still hold. Only the block classes whose forward this
file reproduces are swapped (``SUPPORTED``); ``build_block`` returns None for anything else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from fastsync.errors import MoEPatchError
from fastsync.moe.dispatch import DeepEPDispatcher, deep_ep_import_error, ep_experts_forward, require_deep_ep
from fastsync.moe.experts import uses_default_swiglu, grouped_mm_available, grouped_mm_fits, local_experts_forward
from fastsync.moe.replay import RoutingReplay
from fastsync.moe.te import require_te, swap_linears, te_import_error

__all__ = ["ArchSpec", "SUPPORTED", "Backend", "resolve_backend", "FastExperts", "build_block", "install_block", "is_moe_block",
           "ep_shard"]

BACKENDS = ("auto", "torch", "grouped_mm", "te", "deepep")
EXPERT_PARAMS = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias")


@dataclass(frozen=True, slots=True)
class ArchSpec:
    """How one HF block class routes and mixes; see each model's ``modeling_*.py``."""

    module: str  #: the transformers module defining the class
    router: str  #: attribute holding the router
    shared: str  #: "none" | "qwen2" (shared_expert * sigmoid(shared_expert_gate)) | "deepseek"
    rule: str  #: routing-replay weight rule (fastsync.moe.replay.replay_weights)
    returns_scores: bool = False  #: GPT-OSS's block returns (hidden, router_scores)
    jitter: bool = False  #: Mixtral multiplies inputs by uniform noise in training


SUPPORTED: dict[str, ArchSpec] = {
    "Qwen3MoeSparseMoeBlock": ArchSpec("transformers.models.qwen3_moe.modeling_qwen3_moe", "gate", "none", "softmax"),
    "Qwen2MoeSparseMoeBlock": ArchSpec("transformers.models.qwen2_moe.modeling_qwen2_moe", "gate", "qwen2", "softmax"),
    "MixtralSparseMoeBlock": ArchSpec(
        "transformers.models.mixtral.modeling_mixtral", "gate", "none", "mixtral", jitter=True
    ),
    "DeepseekV3MoE": ArchSpec(
        "transformers.models.deepseek_v3.modeling_deepseek_v3", "gate", "deepseek", "sigmoid_group"
    ),
    "GptOssMLP": ArchSpec(
        "transformers.models.gpt_oss.modeling_gpt_oss", "router", "none", "topk_softmax", returns_scores=True
    ),
}


def is_moe_block(module: nn.Module) -> bool:
    """A sparse-MoE block: it has an ``experts`` child holding 3-D expert weights (HF v5) or a
    list of expert modules (older layouts)."""
    experts = getattr(module, "experts", None)
    if not isinstance(experts, nn.Module):
        return False
    if isinstance(experts, nn.ModuleList):
        return True
    return any(p.dim() == 3 for p in experts.parameters(recurse=False))


# ---- backend resolution ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Backend:
    """What actually runs: the experts kernel, the dispatch, and whether TE Linear swaps apply."""

    kernel: str  #: "torch" (per-expert mm loop) | "grouped_mm" (torch's grouped GEMM)
    dispatch: str  #: "local" | "all_to_all" | "deepep"
    te: bool
    note: str  #: why, for the one log line
    strict: bool = True  #: False for "auto": a block grouped_mm cannot take falls back to the loop

    def describe(self, requested: str, ep_size: int) -> str:
        return (
            f"fastsync.moe: backend={requested!r} runs experts kernel={self.kernel!r}, dispatch={self.dispatch!r}"
            f" (ep_size={ep_size}), TransformerEngine={'on' if self.te else 'off'}; {self.note}"
        )


def resolve_backend(requested: str, device: torch.device, ep_group: Any) -> Backend:
    """Turn a requested backend into what runs; MoEPatchError where the request cannot run."""
    if requested not in BACKENDS:
        raise MoEPatchError(f"unknown MoE backend {requested!r}; choose one of {BACKENDS}")
    ep = ep_group is not None and dist.get_world_size(ep_group) > 1
    a2a = "all_to_all" if ep else "local"
    if requested == "te":
        require_te()
        return Backend("grouped_mm", a2a, True, "TransformerEngine Linear for dense layers, torch grouped_mm experts")
    if requested == "deepep":
        require_deep_ep(ep_group)
        return Backend("grouped_mm", "deepep", False, "DeepEP dispatch/combine")
    if requested == "grouped_mm":
        if not grouped_mm_available():
            raise MoEPatchError("backend='grouped_mm' requested but this torch has no F.grouped_mm / torch._grouped_mm")
        return Backend("grouped_mm", a2a, False, "torch grouped_mm as requested")
    if requested == "torch":
        return Backend("torch", a2a, False, "per-expert mm loop as requested")
    # auto
    te_why = te_import_error()
    ep_why = deep_ep_import_error() if ep else "no EP group"
    kernel = "grouped_mm" if grouped_mm_available() else "torch"
    if device.type == "cuda":
        dispatch = "deepep" if (ep and ep_why is None) else a2a
        return Backend(
            kernel, dispatch, te_why is None,
            f"TransformerEngine: {te_why or 'available'}; DeepEP: {ep_why or 'available'}", strict=False,
        )
    return Backend(
        kernel, a2a, False, f"TransformerEngine not used: {te_why}; DeepEP not used: {ep_why}", strict=False
    )


# ---- experts ------------------------------------------------------------------------------------


class FastExperts(nn.Module):
    """Takes over an HF experts module: same parameter names and (gathered) shapes.

    Without EP it holds the very same ``nn.Parameter`` objects. With an EP group of size ``n`` it
    holds rows ``[r*E/n, (r+1)*E/n)`` of each expert parameter (``num_local_experts`` of them);
    ``state_dict()`` all-gathers them to the full HF shape (collective: every EP rank must call it,
    as with FSDP) and ``load_state_dict`` accepts full tensors and keeps this rank's rows.
    """

    def __init__(self, hf: nn.Module, *, ep_group: Any, backend: Backend, dispatcher: Any = None) -> None:
        super().__init__()
        for key, value in vars(hf).items():
            if not key.startswith("_"):
                setattr(self, key, value)
        for key, sub in hf._modules.items():
            self.add_module(key, sub)
        self.hf_apply_gate = type(hf)._apply_gate  # HF's activation, which fused_swiglu checks for
        self.fused_swiglu = uses_default_swiglu(self)
        self.has_bias = bool(getattr(hf, "has_bias", False))
        self.is_transposed = bool(getattr(hf, "is_transposed", False))
        self.num_experts = int(hf.num_experts)
        self.kernel = backend.kernel
        self.dispatch = backend.dispatch
        self.ep_group = ep_group if backend.dispatch != "local" else None
        self.ep_size = dist.get_world_size(self.ep_group) if self.ep_group is not None else 1
        self.ep_rank = dist.get_rank(self.ep_group) if self.ep_group is not None else 0
        self.num_local_experts = self.num_experts // self.ep_size
        self._dispatcher = dispatcher
        self.expert_param_names: list[str] = []
        lo, hi = self.ep_rank * self.num_local_experts, (self.ep_rank + 1) * self.num_local_experts
        for name, p in hf._parameters.items():  # HF's order, so state_dict() order is HF's
            if p is None:
                continue
            self.expert_param_names.append(name)
            if self.ep_size == 1:
                self.register_parameter(name, p)
            else:
                shard = nn.Parameter(p.detach()[lo:hi].clone(), requires_grad=p.requires_grad)
                shard._fastsync_ep_shard = (lo, hi, self.num_experts)  # dim-0 rows of the full tensor
                self.register_parameter(name, shard)
        if self.kernel == "grouped_mm" and (why := grouped_mm_fits(self)) is not None:
            if backend.strict:
                raise MoEPatchError(f"{type(hf).__name__}: grouped_mm cannot run these experts: {why}")
            self.kernel = "torch"
        if self.ep_size > 1:
            self.register_state_dict_post_hook(_gather_expert_shards)
            self.register_load_state_dict_pre_hook(_slice_expert_shards)

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.hf_apply_gate(self, gate_up)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        if self.dispatch == "local":
            return local_experts_forward(self, hidden_states, top_k_index, top_k_weights, backend=self.kernel)
        if self.dispatch == "deepep":
            return self._dispatcher.forward(self, hidden_states, top_k_index, top_k_weights, backend=self.kernel)
        return ep_experts_forward(
            self, hidden_states, top_k_index, top_k_weights, group=self.ep_group, backend=self.kernel
        )

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, local={self.num_local_experts}, ep_size={self.ep_size}, "
            f"kernel={self.kernel}, dispatch={self.dispatch}"
        )


def _gather_expert_shards(module: FastExperts, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    for name in module.expert_param_names:
        key = prefix + name
        if key not in state_dict:
            continue
        local = state_dict[key].detach().contiguous()
        parts = [torch.empty_like(local) for _ in range(module.ep_size)]
        dist.all_gather(parts, local, group=module.ep_group)
        state_dict[key] = torch.cat(parts, dim=0)


def _slice_expert_shards(module: FastExperts, state_dict: dict, prefix: str, *args: Any) -> None:
    lo, hi = module.ep_rank * module.num_local_experts, (module.ep_rank + 1) * module.num_local_experts
    for name in module.expert_param_names:
        key = prefix + name
        if key in state_dict and state_dict[key].shape[0] == module.num_experts:
            state_dict[key] = state_dict[key][lo:hi]


# ---- the block ------------------------------------------------------------------------------------


def ep_shard(p: torch.Tensor) -> tuple[int, int, int] | None:
    """``(start, stop, full_dim0)`` when ``p`` is an expert-parallel shard a swapped block holds (rows
    ``[start, stop)`` of dim 0 of the full HF tensor), else None."""
    return getattr(p, "_fastsync_ep_shard", None)


class FastSyncMoEBlock(nn.Module):
    """Mixin placed before the HF block class: the forward below replaces HF's, reproducing it
    with ``self.experts`` a ``FastExperts`` (see the module docstring)."""

    _fastsync_spec: ArchSpec
    _fastsync_name: str = ""
    _fastsync_replay: RoutingReplay | None = None

    def _route(self, router: nn.Module, logits: torch.Tensor, idx: torch.Tensor, w: torch.Tensor):
        if self._fastsync_replay is None:
            return idx, w
        return self._fastsync_replay.route(self._fastsync_name, self._fastsync_spec.rule, router, logits, idx, w)

    def forward(self, hidden_states: torch.Tensor) -> Any:
        spec = self._fastsync_spec
        router = getattr(self, spec.router)
        if spec.shared == "deepseek":  # DeepseekV3MoE.forward
            residuals, orig_shape = hidden_states, hidden_states.shape
            logits, w, idx = router(hidden_states)
            idx, w = self._route(router, logits, idx, w)
            x = hidden_states.view(-1, hidden_states.shape[-1])
            out = self.experts(x, idx, w).view(*orig_shape)
            return out + self.shared_experts(residuals)
        batch, seq, hidden = hidden_states.shape
        if spec.jitter and self.training and self.jitter_noise > 0:  # MixtralSparseMoeBlock.forward
            hidden_states *= torch.empty_like(hidden_states).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
        x = hidden_states.reshape(-1, hidden)
        logits, w, idx = router(x)
        idx, w = self._route(router, logits, idx, w)
        out = self.experts(x, idx, w)
        if spec.shared == "qwen2":  # Qwen2MoeSparseMoeBlock.forward
            out = out + F.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        out = out.reshape(batch, seq, hidden)
        return (out, w) if spec.returns_scores else out


_SUBCLASSES: dict[type, type] = {}


def _fast_class(hf_cls: type) -> type:
    if hf_cls not in _SUBCLASSES:
        _SUBCLASSES[hf_cls] = type(f"FastSync{hf_cls.__name__}", (FastSyncMoEBlock, hf_cls), {})
    return _SUBCLASSES[hf_cls]


def supported_spec(module: nn.Module) -> ArchSpec | None:
    """The spec for this block's exact class, or None (subclasses and look-alikes are not ours)."""
    cls = type(module)
    spec = SUPPORTED.get(cls.__name__)
    if spec is None or cls.__module__ != spec.module:
        return None
    experts = getattr(module, "experts", None)
    if experts is None or not all(isinstance(getattr(experts, n, None), nn.Parameter) for n in EXPERT_PARAMS[:2]):
        return None
    if not hasattr(experts, "_apply_gate") or not hasattr(experts, "num_experts"):
        return None
    if any(p is None or p.shape[0] != experts.num_experts for p in experts._parameters.values()):
        return None  # every expert parameter must be sliceable by expert along dim 0
    return spec


def build_block(
    module: nn.Module, name: str, ep_group: Any, backend: str, replay: RoutingReplay | None = None
) -> nn.Module | None:
    """The replacement for one HF MoE block, or None if its class is not supported.

    Does not modify ``module``; raises MoEPatchError for settings it cannot honour.
    """
    spec = supported_spec(module)
    if spec is None:
        return None
    device = module.experts.gate_up_proj.device
    chosen = resolve_backend(backend, device, ep_group)
    ep_size = dist.get_world_size(ep_group) if ep_group is not None else 1
    num_experts = int(module.experts.num_experts)
    if num_experts % ep_size:
        raise MoEPatchError(
            f"{name} ({type(module).__name__}): ep_size={ep_size} does not divide num_experts={num_experts}"
        )
    dispatcher = None
    if chosen.dispatch == "deepep":
        w = module.experts.gate_up_proj  # (E, 2I, H), or (E, H, 2I) when transposed (GPT-OSS)
        hidden = w.shape[1] if getattr(module.experts, "is_transposed", False) else w.shape[-1]
        hidden_bytes = hidden * max(w.element_size(), 2)  # DeepEP's sizing rule
        dispatcher = DeepEPDispatcher(ep_group, hidden_bytes)
    new = _fast_class(type(module)).__new__(_fast_class(type(module)))
    nn.Module.__init__(new)
    for key, value in vars(module).items():
        if not key.startswith("_"):
            setattr(new, key, value)
    for key, value in module._parameters.items():
        new.register_parameter(key, value)
    for key, value in module._buffers.items():
        new.register_buffer(key, value, persistent=key not in module._non_persistent_buffers_set)
    for key, sub in module._modules.items():
        new.add_module(key, sub)
    new.experts = FastExperts(module.experts, ep_group=ep_group, backend=chosen, dispatcher=dispatcher)
    new._fastsync_spec = spec
    new._fastsync_name = name
    new._fastsync_replay = replay
    new._fastsync_te = chosen.te  # applied by install_block(), once every block of the model is built
    return new


def install_block(new: nn.Module) -> None:
    """Finish a built block as it goes into the model: swap its shared experts' Linears for
    TransformerEngine's when TE was chosen. Not done in ``build_block``, because the shared-expert
    modules are the original block's own: a later block refusing its build must leave them as they were."""
    if getattr(new, "_fastsync_te", False):
        for key in ("shared_expert", "shared_experts"):
            if isinstance(getattr(new, key, None), nn.Module):
                swap_linears(getattr(new, key))
