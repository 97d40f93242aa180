"""Name maps: trainer (HF transformers-v5) parameters -> the engine's logical tensors.

A :class:`NameMap` lists every tensor the engine holds for a model, under the engine's own
name, with its full (unsharded) shape, how it is split across tensor/expert-parallel ranks
(:class:`EngineParam` ``style``), and which boxes of which trainer parameters fill it
(:class:`Segment`). ``fastsync.layout.engine`` turns it into per-rank ``EngineTensor`` pieces.

Parallel styles (what vLLM's layers do with ``tp`` ranks):

* ``replicated``: every rank holds the whole tensor (norms, router gates, MLA's ``fused_qkv_a_proj``).
* ``column``: ``shard_dim`` is split; the tensor is the concatenation of ``parts`` along it
  (``qkv_proj`` = q|k|v, ``gate_up_proj`` = gate|up) and each part is split on its own, so a
  rank's slice is [q_r | k_r | v_r]. A part with ``heads`` > 0 is split by whole heads; when it has
  fewer heads than ranks each head is replicated over ``tp // heads`` ranks (vLLM's KV-head
  replication).
* ``row``: ``shard_dim`` (the input dim) is split evenly (``o_proj``, ``down_proj``).
* ``vocab``: dim 0 is padded to a multiple of 64 then split evenly (VocabParallelEmbedding /
  ParallelLMHead); a rank's engine tensor is its whole padded slice, whose filled prefix is the
  logical shape (``layout/padding.py``).
* With ``expert_dim`` set (fused MoE ``w13_weight`` [E, 2I, H], ``w2_weight`` [E, H, I]) that
  dim is split over expert-parallel ranks first (vLLM's linear placement), then ``style`` applies
  with the MoE tensor-parallel size (``tp`` without EP, 1 with EP).

Built-in maps (vLLM 0.32 names) live in ``fastsync.engines.vllm.names`` and register through the
``fastsync_name_map`` hook in ``fastsync._builtin.namemaps``; :func:`get_name_map` asks the hook.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fastsync.errors import LayoutError
from fastsync.layout.box import Box, box_numel, box_shape, full_box, intersect, squeeze_shape

__all__ = ["STYLES", "Part", "Segment", "EngineParam", "NameMap", "get_name_map", "DEFAULT_ENGINE"]

STYLES = ("replicated", "column", "row", "vocab")

#: The engine a name map is asked for when the caller names none (the only built-in engine).
DEFAULT_ENGINE = "vllm"


@dataclass(frozen=True, slots=True)
class Part:
    """One fused sub-tensor along a column tensor's ``shard_dim`` (q, k, v; gate, up)."""

    size: int
    heads: int = 0


@dataclass(frozen=True, slots=True)
class Segment:
    """``engine_full[dst_box] = trainer_full[src][src_box]`` (same elements, row-major order; the
    shapes agree once size-1 dims are dropped). ``dst_box`` is in the engine tensor's full,
    unsharded coordinates."""

    src: str
    src_box: Box
    dst_box: Box


@dataclass(frozen=True, slots=True)
class EngineParam:
    """One logical engine tensor: name, full shape, parallel style, where its bytes come from.

    ``quantizable``: a linear weight vLLM stores as FP8 under block quantisation.
    ``dtype``: a fixed engine dtype (e.g. ``"float32"`` for DeepSeek's router bias) or None for
    the engine's model dtype.
    """

    name: str
    shape: tuple[int, ...]
    style: str
    segments: tuple[Segment, ...]
    shard_dim: int = 0
    parts: tuple[Part, ...] = ()
    expert_dim: int | None = None
    quantizable: bool = False
    dtype: str | None = None

    def __post_init__(self) -> None:
        if self.style not in STYLES:
            raise LayoutError(f"engine tensor {self.name!r}: unknown style {self.style!r}; known: {STYLES}")
        if self.style == "column" and sum(p.size for p in self.parts) != self.shape[self.shard_dim]:
            raise LayoutError(
                f"engine tensor {self.name!r}: parts {[p.size for p in self.parts]} do not tile dim "
                f"{self.shard_dim} of shape {self.shape}"
            )


@dataclass(slots=True)
class NameMap:
    """All engine tensors of a model plus the trainer parameters that deliberately feed nothing
    (``unused``: name -> reason, e.g. a tied ``lm_head.weight``). Everything else must be read.
    ``engine_only``: name suffixes of parameters the engine creates that no trainer tensor feeds
    (FP8 KV-cache scales ...): receivers leave them alone rather than report them missing.
    """

    architecture: str
    engine: str
    params: list[EngineParam]
    unused: dict[str, str] = field(default_factory=dict)
    engine_only: dict[str, str] = field(default_factory=dict)

    def is_engine_only(self, name: str) -> bool:
        return any(name.endswith(suffix) for suffix in self.engine_only)

    def by_name(self) -> dict[str, EngineParam]:
        return {p.name: p for p in self.params}

    def sources(self) -> set[str]:
        return {s.src for p in self.params for s in p.segments}

    def validate(self, params: dict) -> None:
        """Every trainer parameter feeds some engine tensor (or is listed in ``unused``), every
        segment reads inside its parameter and lands inside its engine tensor, and segments fill
        each engine tensor exactly once. Raises LayoutError naming the parameter/tensor."""
        names: set[str] = set()
        read: set[str] = set()
        for ep in self.params:
            if ep.name in names:
                raise LayoutError(f"{self.engine} name map for {self.architecture}: engine tensor {ep.name!r} listed twice")
            names.add(ep.name)
            full = full_box(ep.shape)
            filled = 0
            boxes: list[Box] = []
            for seg in ep.segments:
                spec = params.get(seg.src)
                if spec is None:
                    raise LayoutError(
                        f"engine tensor {ep.name!r} reads trainer parameter {seg.src!r}, which the model does not have"
                    )
                read.add(seg.src)
                if len(seg.src_box) != len(spec.shape) or intersect(seg.src_box, full_box(spec.shape)) != seg.src_box:
                    raise LayoutError(f"engine tensor {ep.name!r}: box {seg.src_box} outside {seg.src!r} {spec.shape}")
                if len(seg.dst_box) != len(ep.shape) or intersect(seg.dst_box, full) != seg.dst_box:
                    raise LayoutError(f"engine tensor {ep.name!r}: segment {seg.dst_box} outside shape {ep.shape}")
                if squeeze_shape(box_shape(seg.dst_box)) != squeeze_shape(box_shape(seg.src_box)):
                    raise LayoutError(
                        f"engine tensor {ep.name!r}: segment {box_shape(seg.dst_box)} cannot take "
                        f"{box_shape(seg.src_box)} of {seg.src!r}"
                    )
                boxes.append(seg.dst_box)
                filled += box_numel(seg.dst_box)
            _check_disjoint(ep.name, boxes)
            if filled != box_numel(full):
                raise LayoutError(
                    f"engine tensor {ep.name!r}: no trainer parameter fills {box_numel(full) - filled} "
                    f"of its {box_numel(full)} elements"
                )
        for name in params:
            if name not in read and name not in self.unused:
                raise LayoutError(
                    f"trainer parameter {name!r} maps to no {self.engine} tensor of {self.architecture} "
                    "(not read by any engine tensor, not declared unused)"
                )
        stale = set(self.unused) - set(params)
        if stale:
            raise LayoutError(f"name map declares unused parameter(s) the model lacks: {sorted(stale)[:5]}")


def _check_disjoint(name: str, boxes: list[Box]) -> None:
    """LayoutError if two boxes overlap: a sweep along dim 0 (per-expert segments of a fused MoE
    tensor only meet the few segments of their own expert)."""
    if len(boxes) < 2 or not boxes[0]:
        if len(boxes) > 1:
            raise LayoutError(f"engine tensor {name!r}: {len(boxes)} segments fill one scalar")
        return
    order = sorted(boxes)
    for i, a in enumerate(order):
        for b in order[i + 1 :]:
            if b[0][0] >= a[0][1]:
                break
            if intersect(a, b) is not None:
                raise LayoutError(f"engine tensor {name!r}: segments {a} and {b} overlap")


def get_name_map(architecture: str, config: dict, params: dict | None = None, *, engine: str = DEFAULT_ENGINE) -> NameMap:
    """The name map for ``architecture`` on ``engine`` from the ``fastsync_name_map`` hook (first
    plugin that answers wins). With ``params`` (an inventory's ``params``) it is validated against them.
    Raises LayoutError naming the architecture when no plugin knows it."""
    from fastsync import plugins

    nm = plugins.hook().fastsync_name_map(architecture=architecture, config=config, engine=engine)
    if nm is None:
        raise LayoutError(
            f"no name map for architecture {architecture!r} on engine {engine!r}; registered architectures: "
            f"{sorted(plugins.architectures())} (plugins add name maps through the fastsync_name_map hook)"
        )
    if not isinstance(nm, NameMap):
        raise LayoutError(f"fastsync_name_map for {architecture!r} returned {type(nm).__name__}, not a NameMap")
    if params is not None:
        nm.validate(params)
    return nm
