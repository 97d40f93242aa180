"""The benchmark's model: a Qwen3-MoE-shaped synthetic inventory scaled to a byte size (or a
registered preset trimmed to fit), FSDP2 trainer shards, a vLLM-like TP engine layout with fused
``qkv_proj`` / ``w13`` tensors, the plan between them, and deterministic shard values.

Values are a seeded normal draw per (parameter, shard box), so any process can regenerate what
a trainer holds; version ``v`` holds ``(-1)**v`` times the draw (negation is exact in bf16), so
consecutive versions differ in every non-zero byte.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from fastsync.errors import ConfigError
from fastsync.layout.box import box_numel, box_shape, box_slices
from fastsync.layout.types import EngineLayout, ParamSpec, Shard, TrainerLayout
from fastsync.plan.types import Plan

__all__ = ["BenchModel", "build_bench_model", "shard_values", "full_values", "scaled_dims"]


@dataclass(slots=True)
class BenchModel:
    params: dict[str, ParamSpec]
    trainer: TrainerLayout
    engine: EngineLayout
    plan: Plan
    description: str

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.params.values())


def scaled_dims(size_bytes: int, tp: int):
    """Qwen3-MoE-like dims whose bf16 inventory is close to ``size_bytes``: many tensors of mixed
    sizes (norms, router, attention, fused experts, embedding and lm_head)."""
    from fastsync.bench.synthetic import ModelDims

    if size_bytes >= 256 << 20:
        base = dict(hidden=1024, q_dim=1024, kv_dim=256, experts=16, moe_inter=512, vocab=16384)
    elif size_bytes >= 16 << 20:
        base = dict(hidden=512, q_dim=512, kv_dim=128, experts=8, moe_inter=256, vocab=4096)
    else:
        base = dict(hidden=128, q_dim=128, kv_dim=64, experts=4, moe_inter=64, vocab=512)
    for k in ("q_dim", "kv_dim", "moe_inter", "vocab"):
        if base[k] % tp:
            raise ConfigError(f"--rollouts {tp} does not divide the synthetic model's {k}={base[k]}")
    one = ModelDims(layers=1, **base)
    from fastsync.bench.synthetic import small_model

    p1 = sum(p.nbytes for p in small_model(one).values())
    p2 = sum(p.nbytes for p in small_model(ModelDims(layers=2, **base)).values())
    per_layer, fixed = p2 - p1, 2 * p1 - p2
    layers = max(1, round((size_bytes - fixed) / per_layer))
    return ModelDims(layers=layers, **base)


def build_bench_model(*, trainers: int, rollouts: int, size_bytes: int | None = None,
                      preset: str | None = None, fp8: bool = False, replicas: int = 1,
                      fanout: str = "chain") -> BenchModel:
    """Inventory, layouts and plan for ``trainers`` FSDP ranks and ``replicas`` identical engines of
    TP=``rollouts // replicas`` each. With replicas, the plan is built once per replica and fanned
    out with ``fanout`` (``chain``: each byte leaves its trainer rank once, engine ranks relay)."""
    from fastsync.plan.planner import build_plan
    from fastsync.bench.synthetic import engine_layout, fsdp_layout, small_model

    if trainers < 1 or rollouts < 1:
        raise ConfigError(f"need at least one trainer and one engine rank, got {trainers} and {rollouts}")
    if replicas < 1 or rollouts % replicas:
        raise ConfigError(f"--replicas {replicas} must be positive and divide --rollouts {rollouts}")
    tp = rollouts // replicas
    if preset is not None:
        if replicas != 1:
            raise ConfigError("--replicas needs the synthetic model (--size-gb without --model)")
        return _preset_model(preset, trainers, rollouts, size_bytes)
    if size_bytes is None or size_bytes <= 0:
        raise ConfigError("give --size-gb (positive) or --model PRESET")
    dims = scaled_dims(size_bytes, tp)
    params = small_model(dims)
    trainer = fsdp_layout(params, trainers)
    engine = engine_layout(params, dims, tp=tp, replicas=replicas, expert_parallel=False, fp8=fp8)
    plan = build_plan(params, trainer, engine, fanout=fanout if replicas > 1 else "off")
    desc = (f"synthetic Qwen3-MoE-like{' (FP8 engine)' if fp8 else ''}: {dims.layers} layers, hidden {dims.hidden}, {dims.experts} experts, "
            f"{len(params)} tensors" + (f", {replicas} engine replicas of TP{tp} ({fanout})" if replicas > 1 else ""))
    return BenchModel(params, trainer, engine, plan, desc)


def _preset_model(preset: str, trainers: int, rollouts: int, size_bytes: int | None) -> BenchModel:
    from fastsync.layout.engine import build_engine_layout
    from fastsync.layout.namemap import get_name_map
    from fastsync.layout.trainer import fsdp_layout
    from fastsync.models.inventory import inventory_from_config, load_inventory
    from fastsync.plan.planner import build_plan

    inv = load_inventory(preset)
    if size_bytes is not None:
        cfg = dict(inv.config)
        layers = int(cfg.get("num_hidden_layers", 1))
        fixed = sum(p.nbytes for n, p in inv.params.items() if not n.startswith("model.layers."))
        per_layer = (inv.nbytes - fixed) / max(layers, 1)
        smallest = fixed + per_layer
        if size_bytes < smallest:
            raise ConfigError(f"--size-gb {size_bytes / (1 << 30):.3g}: preset {preset!r} trimmed to one layer is still "
                              f"{smallest / (1 << 30):.3g} GB (embedding, lm_head and one layer); give --size-gb "
                              f"{smallest / (1 << 30):.3g} or more, or omit --model for a synthetic model of that size")
        cfg["num_hidden_layers"] = max(1, min(layers, int((size_bytes - fixed) // max(per_layer, 1))))
        inv = inventory_from_config(cfg, name=inv.name)
    name_map = get_name_map(inv.architecture, inv.config, inv.params)
    trainer = fsdp_layout(inv.params, trainers)
    engine = build_engine_layout(inv, name_map, tp=rollouts)
    plan = build_plan(inv.params, trainer, engine, allow_unread=True)
    layers = inv.config.get("num_hidden_layers")
    return BenchModel(dict(inv.params), trainer, engine, plan, f"preset {preset} ({layers} layers)")


def _seed(name: str, box: tuple) -> int:
    return zlib.crc32(f"{name}{box}".encode())


def shard_values(spec: ParamSpec, box: tuple, out: torch.Tensor | None = None) -> torch.Tensor:
    """The version-0 values of ``spec``'s ``box`` (deterministic in any process)."""
    g = torch.Generator().manual_seed(_seed(spec.name, box))
    vals = torch.randn(box_shape(box), generator=g, dtype=torch.float32).mul_(0.02)
    dt = getattr(torch, spec.dtype)
    if out is None:
        return vals.to(dt)
    out.view(box_shape(box)).copy_(vals)
    return out


def full_values(spec: ParamSpec, shards: tuple[Shard, ...], version: int,
                delta_fraction: float | None = None) -> torch.Tensor:
    """The whole parameter at ``version``, assembled from its shards' draws: every element
    negated at odd versions, or (``delta_fraction``, ``fastsync bench --delta``) a seeded
    fraction of each shard's elements negated at every version (:func:`step_values`)."""
    full = torch.empty(spec.shape, dtype=getattr(torch, spec.dtype))
    for sh in shards:
        if box_numel(sh.box):
            part = shard_values(spec, sh.box)
            if delta_fraction is not None:
                for v in range(1, version + 1):
                    step_values(spec, sh.box, v, delta_fraction, part)
            full[box_slices(sh.box)] = part
    if delta_fraction is None and version % 2:
        full.neg_()
    return full


def step_values(spec: ParamSpec, box: tuple, version: int, fraction: float, out: torch.Tensor) -> None:
    """Move ``out`` (the shard ``box`` of ``spec``) from ``version - 1`` to ``version`` the way an
    optimizer step moves a few elements: negate a seeded ``fraction`` of them (the same draw in
    every process; what a delta sync then carries)."""
    g = torch.Generator().manual_seed(_seed(f"{spec.name}@{version}", box))
    mask = torch.rand(out.numel(), generator=g) < fraction
    flat = out.view(-1)
    flat[mask] = -flat[mask]


def trainer_buffers(model: BenchModel, rank: int, device: str = "cpu"
                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, list[Shard]]]:
    """One flat buffer per trainer rank (like a flat FSDP parameter), its per-parameter views
    (each a shard, ``local_offset`` 0) filled with the version-0 values, on ``device`` (the
    values are drawn on the CPU, so they are the same bytes on any device)."""
    mine = model.trainer.shards_on(rank)
    dtypes = {model.params[n].dtype for n in mine}
    if len(dtypes) > 1:
        raise ConfigError(f"benchmark trainer buffers need one dtype, got {sorted(dtypes)}")
    dt = getattr(torch, dtypes.pop() if dtypes else "bfloat16")
    total = sum(box_numel(shs[0].box) for shs in mine.values())
    flat = torch.empty(total, dtype=dt)
    views: dict[str, torch.Tensor] = {}
    shards: dict[str, list[Shard]] = {}
    off = 0
    for name in sorted(mine):
        sh = mine[name][0]
        n = box_numel(sh.box)
        view = flat[off: off + n]
        if n:
            shard_values(model.params[name], sh.box, out=view)
        views[name] = view
        shards[name] = [Shard(rank, sh.box, 0)]
        off += n
    if torch.device(device).type != "cpu":
        flat = flat.to(device)
        views = {n: flat[v.storage_offset(): v.storage_offset() + v.numel()] for n, v in views.items()}
    return flat, views, shards


def reference_tensors(model: BenchModel, rank: int, version: int,
                      delta_fraction: float | None = None) -> dict[str, torch.Tensor]:
    """What inference ``rank`` must hold after syncing ``version`` (computed without transports)."""
    from fastsync.bench.local import reference_engine_tensors

    needed = {p.src for t in model.engine.tensors[rank].values() for p in t.pieces}
    full = {n: full_values(model.params[n], model.trainer.shards[n], version, delta_fraction) for n in needed}
    sub = EngineLayout(model.engine.world_size, {rank: model.engine.tensors[rank]}, {}, model.engine.kind)
    return reference_engine_tensors(full, sub)[rank]
