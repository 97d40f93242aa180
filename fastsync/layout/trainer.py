"""Trainer layouts from parallelism settings: FSDP2, HSDP, DeepSpeed ZeRO-3, Megatron TP x PP x EP.

Each builder takes the model's parameters (an ``Inventory`` or its ``params`` dict) and returns a
validated :class:`~fastsync.layout.types.TrainerLayout`. Live models are described from their
DTensors instead (``fastsync.layout.dtensor``); these builders are the same layouts for planning
without a cluster, and the DTensor test checks that both agree.

* FSDP2 ``fully_shard`` over N ranks: ``Shard(0)`` with ``torch.chunk`` bounds (ceil-sized
  chunks, trailing ranks possibly empty), one box per rank, local offset 0.
* HSDP over a (replicate, shard) mesh: FSDP2 within each shard group, rank = r * shard + s.
* ZeRO-3 over N ranks: each parameter flattened, padded to a multiple of N, rank r holds flat
  elements ``[r*ceil(numel/N), (r+1)*ceil(numel/N))`` clipped to numel: a few boxes per rank at
  increasing local offsets (``flat_range_to_boxes``).
* Megatron: world = tp * pp * dp, rank = (pp_rank * dp + dp_rank) * tp + tp_rank (tp fastest).
  Decoder layers split over pp stages in ``torch.chunk`` order (embedding on the first stage,
  final norm and lm_head on the last). Dense weights are tensor parallel exactly as the name map
  describes (column by heads, row by input dim, vocab padded to 128 * tp), replicated over dp.
  Routed experts use expert tensor parallel 1 when ep > 1 (Megatron's usual MoE setting): the
  tp * dp ranks of a stage regroup as ep x (tp*dp/ep), experts split evenly over ep and
  replicated over the rest; with ep = 1 experts are tensor parallel like dense weights.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from fastsync.errors import ConfigError, LayoutError
from fastsync.layout.box import chunk_bounds, flat_range_to_boxes, full_box
from fastsync.layout.types import ParamSpec, Shard, TrainerLayout

__all__ = ["fsdp_layout", "hsdp_layout", "zero3_layout", "megatron_layout", "replicated_layout", "validate_shared",
           "check_params"]


def _params(params: object) -> dict[str, ParamSpec]:
    got = getattr(params, "params", params)
    if not isinstance(got, Mapping):
        raise ConfigError(f"expected an Inventory or a dict of ParamSpec, got {type(params).__name__}")
    return dict(got)


def _positive(**kw: int) -> None:
    for name, v in kw.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"trainer layout: {name} must be a positive integer, got {v!r}")


def _done(layout: TrainerLayout) -> TrainerLayout:
    validate_shared(layout)
    return layout


def validate_shared(layout: TrainerLayout) -> None:
    """``TrainerLayout.validate`` run once per distinct (shape, dtype, shards) combination: the
    builders here share one shard tuple between parameters of equal shape, so a 256-rank FSDP
    layout of Kimi-K2 checks a few dozen tuples instead of ~250,000 shards. Same checks, same
    errors (naming a representative parameter, which holds exactly the same boxes)."""
    reps: dict[tuple, str] = {}
    for name, spec in layout.params.items():
        shards = layout.shards.get(name)
        key = (spec.shape, spec.dtype, id(shards)) if shards else ("missing", name)
        reps.setdefault(key, name)
    sub = TrainerLayout(layout.world_size, {n: layout.params[n] for n in reps.values()},
                        {n: layout.shards[n] for n in reps.values() if n in layout.shards}, kind=layout.kind)
    sub.validate()
    extra = set(layout.shards) - set(layout.params)
    if extra:
        raise LayoutError(f"trainer layout has shards of unknown parameter(s): {sorted(extra)[:5]}")


def _fsdp_shards(spec: ParamSpec, ranks: list[int], shard_dim: int, cache: dict | None = None) -> tuple[Shard, ...]:
    """FSDP2 shards of one parameter; parameters of equal shape share one tuple via ``cache``."""
    key = (spec.shape, ranks[0], len(ranks), shard_dim)
    if cache is not None and key in cache:
        return cache[key]
    got = tuple(_fsdp_shards_uncached(spec, ranks, shard_dim))
    if cache is not None:
        cache[key] = got
    return got


def _fsdp_shards_uncached(spec: ParamSpec, ranks: list[int], shard_dim: int) -> list[Shard]:
    if not spec.shape:
        return [Shard(r, ()) for r in ranks]
    if shard_dim < 0:
        raise LayoutError(f"parameter {spec.name!r}: negative shard dim {shard_dim}")
    if shard_dim >= len(spec.shape):
        shard_dim = 0  # FSDP2 shard_placement_fn style: Shard(d) where the param has dim d, else Shard(0)
    full = full_box(spec.shape)
    out = []
    for r, (a, b) in zip(ranks, chunk_bounds(spec.shape[shard_dim], len(ranks))):
        if b > a:
            out.append(Shard(r, full[:shard_dim] + ((a, b),) + full[shard_dim + 1 :]))
    return out


def fsdp_layout(params: object, world_size: int, *, shard_dim: int = 0) -> TrainerLayout:
    """FSDP2 ``fully_shard`` over ``world_size`` ranks (``Shard(shard_dim)``, torch.chunk bounds).

    ``shard_dim`` > 0 is what a ``shard_placement_fn`` returning ``Shard(d)`` for parameters that
    have dim d (and ``Shard(0)`` for the others) gives: e.g. ``shard_dim=1`` spreads Kimi-K2's
    [384, 4096, 7168] experts over all 256 ranks, where ``Shard(0)`` (chunks of 2 experts) leaves
    the last 64 ranks without expert bytes. Scalars are replicated. Ranks whose chunk is empty
    hold no shard of that parameter."""
    _positive(world_size=world_size)
    ps = _params(params)
    ranks = list(range(world_size))
    cache: dict = {}
    shards = {n: _fsdp_shards(s, ranks, shard_dim, cache) for n, s in ps.items()}
    return _done(TrainerLayout(world_size, ps, shards, kind="fsdp", description=f"fsdp Shard({shard_dim}) x {world_size}"))


def hsdp_layout(params: object, replicate: int, shard: int, *, shard_dim: int = 0) -> TrainerLayout:
    """HSDP: FSDP2 over a 2-D mesh (replicate, shard); rank = r * shard + s."""
    _positive(replicate=replicate, shard=shard)
    ps = _params(params)
    groups = [list(range(r * shard, (r + 1) * shard)) for r in range(replicate)]
    cache: dict = {}
    shards: dict[str, tuple[Shard, ...]] = {}
    for n, s in ps.items():
        key = ("hsdp", s.shape)
        if key not in cache:
            cache[key] = tuple(sh for g in groups for sh in _fsdp_shards(s, g, shard_dim))
        shards[n] = cache[key]
    return _done(TrainerLayout(replicate * shard, ps, shards, kind="hsdp",
                               description=f"hsdp replicate={replicate} x shard={shard}"))


def zero3_layout(params: object, world_size: int) -> TrainerLayout:
    """DeepSpeed ZeRO-3: per parameter, flat range ``[r*ceil(n/N), (r+1)*ceil(n/N))`` clipped."""
    _positive(world_size=world_size)
    ps = _params(params)
    shards: dict[str, tuple[Shard, ...]] = {}
    cache: dict[tuple[int, ...], tuple[Shard, ...]] = {}
    for n, s in ps.items():
        if s.shape in cache:
            shards[n] = cache[s.shape]
            continue
        numel = s.numel
        part = -(-numel // world_size)
        out: list[Shard] = []
        for r in range(world_size):
            a, b = min(r * part, numel), min((r + 1) * part, numel)
            off = 0
            for box in flat_range_to_boxes(a, b, s.shape):
                out.append(Shard(r, box, off))
                off += _numel(box)
        shards[n] = cache[s.shape] = tuple(out)
    return _done(TrainerLayout(world_size, ps, shards, kind="zero3", description=f"zero3 x {world_size}"))


def _numel(box: tuple) -> int:
    n = 1
    for a, b in box:
        n *= b - a
    return n


def replicated_layout(params: object, world_size: int) -> TrainerLayout:
    """Every rank holds every parameter whole (DDP, or a single trainer with world_size 1)."""
    _positive(world_size=world_size)
    ps = _params(params)
    cache: dict[tuple[int, ...], tuple[Shard, ...]] = {}
    shards = {}
    for n, s in ps.items():
        if s.shape not in cache:
            cache[s.shape] = tuple(Shard(r, full_box(s.shape)) for r in range(world_size))
        shards[n] = cache[s.shape]
    return _done(TrainerLayout(world_size, ps, shards, kind="replicated", description=f"replicated x {world_size}"))


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _stage_of(name: str, num_layers: int, pp: int) -> int:
    m = _LAYER.match(name)
    if m:
        layer = int(m.group(1))
        for stage, (a, b) in enumerate(chunk_bounds(num_layers, pp)):
            if a <= layer < b:
                return stage
        raise LayoutError(f"parameter {name!r}: layer {layer} outside {num_layers} layers")
    if name.startswith("model.embed_tokens."):
        return 0
    return pp - 1


def megatron_layout(params: object, *, tp: int, pp: int = 1, ep: int = 1, dp: int = 1,
                    architecture: str | None = None, config: dict | None = None) -> TrainerLayout:
    """Megatron-style TP x PP x EP x DP over HF parameter names (see the module docstring).
    ``params`` may be an Inventory (architecture and config are then taken from it)."""
    from fastsync.layout import engine as eng
    from fastsync.layout.namemap import get_name_map

    _positive(tp=tp, pp=pp, ep=ep, dp=dp)
    ps = _params(params)
    architecture = architecture or getattr(params, "architecture", None)
    config = config if config is not None else getattr(params, "config", None)
    if architecture is None or config is None:
        raise ConfigError("megatron_layout needs the model's architecture and config (pass an Inventory)")
    if (tp * dp) % ep:
        raise ConfigError(f"megatron layout: ep={ep} must divide tp*dp={tp * dp} (experts regroup a stage's ranks)")
    num_layers = int(config.get("num_hidden_layers") or 0)
    if pp > max(num_layers, 1):
        raise ConfigError(f"megatron layout: pp={pp} exceeds the model's {num_layers} layers")
    nm = get_name_map(architecture, config)
    world = tp * pp * dp
    stage_size = tp * dp
    shards: dict[str, list[Shard]] = {n: [] for n in ps}
    offsets: dict[tuple[str, int], int] = {}

    def add(rank: int, src: str, box: tuple) -> None:
        key = (src, rank)
        off = offsets.get(key, 0)
        shards[src].append(Shard(rank, box, off))
        offsets[key] = off + _numel(box)

    for p in nm.params:
        stages = {_stage_of(s.src, num_layers, pp) for s in p.segments}
        if len(stages) != 1:
            raise LayoutError(f"engine tensor {p.name!r} reads parameters of several pipeline stages")
        stage = stages.pop()
        for i in range(stage_size):
            tp_rank = i % tp
            rank = stage * stage_size + i
            if p.expert_dim is not None and ep > 1:
                iv = eng.rank_intervals(p, tp=1, tp_rank=0, ep_size=ep, ep_rank=i % ep)
            else:
                iv = eng.rank_intervals(p, tp=tp, tp_rank=tp_rank, vocab_pad=128 * tp)
            if iv is None:
                continue
            for piece in eng.rank_pieces(p, iv)[1]:
                add(rank, piece.src, piece.src_box)
    for name in nm.unused:
        stage = _stage_of(name, num_layers, pp)
        for i in range(stage_size):
            add(stage * stage_size + i, name, full_box(ps[name].shape))
    out = {n: tuple(v) for n, v in shards.items()}
    desc = f"megatron tp={tp} pp={pp} ep={ep} dp={dp}"
    return _done(TrainerLayout(world, ps, out, kind="megatron", description=desc))


def check_params(layout: TrainerLayout, params: object) -> None:
    """The trainer layout describes exactly the model's parameters with the same shapes: a live
    layout (from DTensors) against an inventory, before planning. LayoutError naming the first
    parameter that is missing, extra or of another shape."""
    ps = _params(params)
    missing = [n for n in ps if n not in layout.params]
    if missing:
        raise LayoutError(f"trainer layout ({layout.kind}) lacks parameter {missing[0]!r} "
                          f"({len(missing)} missing in all)")
    extra = [n for n in layout.params if n not in ps]
    if extra:
        raise LayoutError(f"trainer layout ({layout.kind}) has parameter {extra[0]!r} the model does not "
                          f"({len(extra)} extra in all)")
    for n, spec in ps.items():
        got = layout.params[n].shape
        if tuple(got) != tuple(spec.shape):
            raise LayoutError(f"parameter {n!r}: trainer layout shape {tuple(got)} disagrees with the model's {spec.shape}")
