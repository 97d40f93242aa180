"""Built-in plugin: layout kinds for spec strings (``fsdp:256``, ``hsdp:2x64``, ``zero3:8``,
``megatron:tp8,pp2``, ``replicated:4``, ``vllm:tp8,dp4,ep,replicas4``) and the live-model trainer
layout (DTensor placements), registered through the ``fastsync`` entry-point group like any
third-party plugin. The grammar is documented in ``fastsync.layout.spec``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastsync.hookspecs import hookimpl


@hookimpl
def fastsync_register_layouts(register: Callable[..., None]) -> None:
    from fastsync.layout import spec

    register("fsdp", spec.fsdp_builder, side="trainer")
    register("hsdp", spec.hsdp_builder, side="trainer")
    register("zero3", spec.zero3_builder, side="trainer")
    register("megatron", spec.megatron_builder, side="trainer")
    register("replicated", spec.replicated_builder, side="trainer")
    register("ddp", spec.replicated_builder, side="trainer")
    register("vllm", spec.vllm_builder, side="engine")


@hookimpl
def fastsync_trainer_layout(model: Any, rank: int, world_size: int) -> Any:
    """DTensor placements (FSDP2 / HSDP) and plain modules; None for objects that are not
    torch modules, so other plugins (DeepSpeed, Megatron) can answer."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency
        return None
    if not isinstance(model, torch.nn.Module):
        return None
    from fastsync.layout.dtensor import trainer_layout_from_module

    return trainer_layout_from_module(model, rank, world_size)
