"""What must hold before planning (:func:`~fastsync.plan.planner.build_plan` calls it first): the
model's parameters, the trainer layout and the engine layout agree on names and shapes, every
parameter has shards, every engine rank is inside its world, and every FP8 scale piece covers the
128x128 blocks of its source. Errors name the parameter, rank or tensor.
"""

from __future__ import annotations

from collections.abc import Mapping

from fastsync.errors import LayoutError
from fastsync.layout.box import box_shape, squeeze_shape
from fastsync.layout.types import FP8_BLOCK, EngineLayout, EngineTensor, ParamSpec, TrainerLayout
from fastsync.plan.index import scale_space

__all__ = ["validate_inputs"]


def validate_inputs(params: Mapping[str, ParamSpec], trainer: TrainerLayout, engine: EngineLayout) -> None:
    """Everything that must hold before planning; raises LayoutError/PlanError naming the
    parameter, rank or tensor."""
    for name, spec in params.items():
        tspec = trainer.params.get(name)
        if tspec is None:
            raise LayoutError(f"parameter {name!r} of the model is not in the trainer layout ({trainer.kind})")
        if tuple(tspec.shape) != tuple(spec.shape):
            raise LayoutError(
                f"parameter {name!r}: trainer layout has shape {tuple(tspec.shape)}, model has {tuple(spec.shape)}"
            )
    unknown = sorted(set(trainer.params) - set(params))
    if unknown:
        raise LayoutError(f"trainer layout has parameter(s) the model does not: {unknown[:5]}")
    # Builders share one shard tuple between same-shaped parameters: validate each distinct
    # (shards, shape) once with the layout's own validate(), under the first name using it.
    firsts: dict[tuple[int, tuple[int, ...]], str] = {}
    for name, spec in trainer.params.items():
        shards = trainer.shards.get(name)
        if shards is None:
            raise LayoutError(f"trainer layout ({trainer.kind}) holds no shard of parameter {name!r}")
        firsts.setdefault((id(shards), tuple(spec.shape)), name)
    extra = sorted(set(trainer.shards) - set(trainer.params))
    if extra:
        raise LayoutError(f"trainer layout has shards of unknown parameter(s): {extra[:5]}")
    TrainerLayout(trainer.world_size, {n: trainer.params[n] for n in firsts.values()},
                  {n: trainer.shards[n] for n in firsts.values()}, trainer.kind).validate()
    # Replicas (and TP ranks holding replicated tensors) repeat equal tensors: check each
    # distinct one once, on the first rank holding it, with the layout's own validate().
    distinct: dict[tuple[str, EngineTensor], int] = {}
    seen: set[int] = set()  # replicas share one dict of tensors: look at it once
    for rank in sorted(engine.tensors):
        ts = engine.tensors[rank]
        if id(ts) in seen:
            continue
        seen.add(id(ts))
        for tname, t in ts.items():
            distinct.setdefault((tname, t), rank)
    reduced: dict[int, dict[str, EngineTensor]] = {}
    for (tname, t), rank in distinct.items():
        reduced.setdefault(rank, {})[tname] = t
    EngineLayout(engine.world_size, reduced, kind=engine.kind).validate(dict(params))
    for rank in engine.tensors:
        if not 0 <= rank < engine.world_size:
            raise LayoutError(f"engine rank {rank} outside world size {engine.world_size}")
    for (tname, t), rank in distinct.items():
        for p in t.pieces:
            if p.transform == "fp8_scale":
                _, ext = scale_space(p.src_box, p.src_box, FP8_BLOCK)
                if squeeze_shape(ext) != squeeze_shape(box_shape(p.dst_box)):
                    raise LayoutError(
                        f"engine rank {rank} tensor {tname!r}: scale region {box_shape(p.dst_box)} "
                        f"does not match the 128x128 blocks {ext} of {p.src!r}{list(p.src_box)}"
                    )
