"""One vLLM engine rank's LoRA slot layout, recorded by running vLLM's own ``set_lora``.

For every LoRA layer of the worker's ``LoRAModelManager`` (``mgr.modules``), the layer's stacked
tensors are swapped for float64 zeros of one slot, ``set_lora(0, A, B)`` is called with
recording tensors (``fastsync.layout.lora.recording_inputs``: PEFT-shaped, every element a
distinct number) for the sub-modules vLLM packs into it (``mgr.packed_modules``: q/k/v into
``qkv_proj``, gate/up into ``gate_up_proj``), and the live stacks are put back. So TP slicing,
fused slices and the corner the copy lands in are vLLM's, for whatever layer classes this vLLM
has, and not restated here.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from fastsync.errors import LayoutError
from fastsync.layout.lora import LoraSource, engine_tensor_name, pieces_from_recording, recording_inputs
from fastsync.layout.types import EngineTensor

__all__ = ["SlotRegion", "record_lora_layout", "lora_manager", "lora_layers_unwrapped"]


@dataclass(frozen=True, slots=True)
class SlotRegion:
    """Where staging tensor ``name`` goes: ``stack(module, kind)[index][slot, 0, :rows, :cols]``."""

    name: str
    module: str
    kind: str
    index: int
    rows: int
    cols: int


@contextmanager
def lora_layers_unwrapped(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """``model`` as vLLM loaded it, for the duration: every LoRA wrapper (vLLM's
    ``BaseLayerWithLoRA``, installed after loading with ``enable_lora=True``, which puts its layer
    under ``.base_layer`` and so renames ``qkv_proj.weight`` to ``qkv_proj.base_layer.weight``)
    swapped back for its base layer, then put back in a ``finally``. The base weights' names,
    the name maps and vLLM's own ``load_weights`` (which the recording runs) then agree, and the
    parameters found are the very tensors the wrappers compute with. Call inside a worker RPC
    (no forward runs meanwhile). A model without LoRA layers is yielded unchanged."""
    try:
        from vllm.lora.layers import BaseLayerWithLoRA
    except ImportError:  # a vLLM without LoRA layers
        yield model
        return
    swapped: list[tuple[torch.nn.Module, str, torch.nn.Module]] = []
    for name, module in model.named_modules():
        if isinstance(module, BaseLayerWithLoRA) and isinstance(module._modules.get("base_layer"), torch.nn.Module):
            parent, _, child = name.rpartition(".")
            swapped.append((model.get_submodule(parent) if parent else model, child, module))
    if any(child == "" for _, child, _ in swapped):
        raise LayoutError("the vLLM model itself is a LoRA wrapper; fastsync cannot unwrap it")
    try:
        for parent, child, module in swapped:
            setattr(parent, child, module._modules["base_layer"])
        yield model
    finally:
        for parent, child, module in reversed(swapped):
            setattr(parent, child, module)


def lora_manager(worker: Any) -> Any:
    """The worker's ``LoRAModelManager``; LayoutError when the engine was started without LoRA."""
    wm = getattr(getattr(worker, "model_runner", None), "lora_manager", None)
    mgr = getattr(wm, "_adapter_manager", None)
    if mgr is None:
        raise LayoutError("this vLLM engine has no LoRA manager: start it with enable_lora=True")
    return mgr


def _sources(mgr: Any, name: str, module: Any, rank: int) -> list[LoraSource]:
    subs = mgr.packed_modules.get(name) or [name]
    base = module.base_layer
    outs = list(getattr(base, "output_sizes", None) or []) if len(subs) > 1 else [int(base.output_size)]
    if len(outs) != len(subs):
        raise LayoutError(f"LoRA layer {name}: {len(subs)} packed sub-modules but output sizes {outs}")
    srcs: list[LoraSource] = []
    for sub, out in zip(subs, outs):
        srcs.append(LoraSource(f"{sub}.lora_A", (rank, int(base.input_size))))
        srcs.append(LoraSource(f"{sub}.lora_B", (int(out), rank)))
    return srcs


def record_lora_layout(mgr: Any, rank: int) -> tuple[dict[str, EngineTensor], list[SlotRegion]]:
    """This engine rank's staging tensors (one per slice of each stack, shaped as the region
    ``set_lora`` writes) with their pieces, and where each goes in a slot, for an adapter of
    rank ``rank``. LayoutError when ``rank`` exceeds the engine's ``max_lora_rank`` or a layer
    is not a box-to-box copy."""
    max_rank = int(mgr.lora_config.max_lora_rank)
    if not 0 < rank <= max_rank:
        raise LayoutError(f"LoRA rank {rank} outside the engine's max_lora_rank {max_rank} (start it with "
                          f"max_lora_rank >= {rank})")
    dtype = str(mgr.lora_config.lora_dtype).removeprefix("torch.")
    tensors: dict[str, EngineTensor] = {}
    regions: list[SlotRegion] = []
    from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA

    for name, module in mgr.modules.items():
        if not isinstance(module, BaseLinearLayerWithLoRA):
            continue  # embeddings, logits, experts: not synced (the slot is reset at each flip)
        srcs = _sources(mgr, name, module, rank)
        inputs = recording_inputs(srcs)
        saved = (module.lora_a_stacked, module.lora_b_stacked)
        module.lora_a_stacked = tuple(torch.zeros((1, *t.shape[1:]), dtype=torch.float64) for t in saved[0])
        module.lora_b_stacked = tuple(torch.zeros((1, *t.shape[1:]), dtype=torch.float64) for t in saved[1])
        try:
            if len(srcs) > 2:
                module.set_lora(0, inputs[0::2], inputs[1::2])
            else:
                module.set_lora(0, inputs[0], inputs[1])
            recorded = {"a": [t[0, 0].clone() for t in module.lora_a_stacked],
                        "b": [t[0, 0].clone() for t in module.lora_b_stacked]}
        except LayoutError:
            raise
        except Exception as e:
            raise LayoutError(f"LoRA layer {name} ({type(module).__name__}): vLLM's set_lora refused the recording "
                              f"({type(e).__name__}: {e})") from e
        finally:
            module.lora_a_stacked, module.lora_b_stacked = saved
        for kind, stacks in recorded.items():
            for i, rec in enumerate(stacks):
                tname = engine_tensor_name(name, kind, i)
                (rows, cols), pieces = pieces_from_recording(tname, rec, srcs)
                tensors[tname] = EngineTensor(tname, (rows, cols), dtype, pieces)
                regions.append(SlotRegion(tname, name, kind, i, rows, cols))
    if not tensors:
        raise LayoutError("the engine's LoRA manager has no linear LoRA layers (check lora target modules)")
    return tensors, regions
