"""The static plan of one LoRA adapter into engines' LoRA staging tensors (pieces recorded by
``fastsync.layout.lora``): trainer rank 0 holds every gathered LoRA matrix whole."""

from __future__ import annotations

from collections.abc import Mapping

from fastsync.errors import LayoutError
from fastsync.layout.trainer import replicated_layout
from fastsync.layout.types import EngineLayout, EngineTensor, ParamSpec
from fastsync.plan.planner import build_plan
from fastsync.plan.types import Plan

__all__ = ["lora_plan"]


def lora_plan(params: Mapping[str, ParamSpec], engine: Mapping[int, Mapping[str, EngineTensor]]) -> Plan:
    """The static plan for one adapter: trainer rank 0 holds every (gathered) LoRA matrix whole
    and writes each engine rank's staging tensors. LayoutError naming a source the engine reads
    that the trainer does not have, or whose shape differs."""
    for rank, tensors in engine.items():
        for t in tensors.values():
            for p in t.pieces:
                spec = params.get(p.src)
                if spec is None:
                    raise LayoutError(f"engine rank {rank} reads LoRA matrix {p.src!r} (for {t.name}), which the "
                                      f"trainer's adapter does not have: are the target modules the same?")
                if any(b > n for (_, b), n in zip(p.src_box, spec.shape)):
                    raise LayoutError(f"engine rank {rank}: {t.name} reads {p.src!r} box {p.src_box}, outside the "
                                      f"trainer's shape {spec.shape}: trainer and engine are not the same model")
    layout = EngineLayout(len(engine), {r: dict(t) for r, t in engine.items()}, {r: 0 for r in engine}, kind="vllm-lora",
                          description="one LoRA slot's staging tensors")
    read = {p.src for ts in engine.values() for t in ts.values() for p in t.pieces}
    unread = sorted(set(params) - read)
    if unread:
        raise LayoutError(f"the trainer's adapter has {len(unread)} LoRA matrix(es) no engine LoRA layer reads, "
                          f"e.g. {unread[0]!r}: the engine was started without that target module")
    return build_plan(params, replicated_layout(dict(params), 1), layout)
