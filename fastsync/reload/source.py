"""An engine replica as a reload *source*: its engine tensors, in the engine's own layout,
become the source boxes of a plan.

A holder engine rank keeps each engine tensor (``qkv_proj``, ``gate_up_proj``, norms, ...) as
one contiguous buffer; the name map's pieces say which box of which trainer (HF) parameter sits
in which box of that buffer. Where that box is a contiguous run of the buffer (whole rows of a
fused tensor: q/k/v blocks of ``qkv_proj``, gate/up blocks of ``gate_up_proj``, TP slices), it
is exactly a :class:`~fastsync.layout.types.Shard` whose ``local_offset`` is the run's first
element in the engine tensor. So a set of holder engines is a ``TrainerLayout`` (kind
``"engine"``) whose ranks are the holders' engine ranks laid end to end, and the existing
planner, sender and transports move their bytes into any other layout, unchanged.

What cannot be a source (refused, naming tensor and parameter): pieces with a transform other
than ``copy`` (an FP8 engine holds quantised bytes, not the parameter), and pieces whose box is
not a contiguous run and cannot be split into runs along leading dims.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastsync.errors import LayoutError
from fastsync.layout.box import Box, box_numel, box_shape
from fastsync.layout.types import EngineLayout, EngineTensor, ParamSpec, Shard, TrainerLayout

__all__ = ["HolderRanks", "engine_source_layout", "local_shards", "merge_sources", "source_tensor_of", "params_of", "target_layout"]


@dataclass(frozen=True, slots=True)
class HolderRanks:
    """One holder engine (replica) as its workers described themselves: ``tensors[i]`` are worker
    i's engine tensors. ``holder`` names it in errors and reports."""

    holder: str
    tensors: tuple[dict[str, EngineTensor], ...]


def _strides(shape: tuple[int, ...]) -> list[int]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return out[::-1]


def _runs(dst: Box, src: Box, shape: tuple[int, ...]) -> list[tuple[int, Box]]:
    """Split ``dst`` (a box of a tensor of ``shape``) into contiguous runs, each with its flat
    element offset and the matching box of ``src``. Returns [] when the split needs a dim
    mapping between boxes of different rank (not supported)."""
    # first dim from which every later dim is full: dims before it must be iterated (extent 1)
    k = len(shape)
    while k > 0 and dst[k - 1] == (0, shape[k - 1]):
        k -= 1
    # dims [0, k-1) must have extent 1 for one run; dim k-1 may be partial
    lead = [i for i in range(max(k - 1, 0)) if dst[i][1] - dst[i][0] > 1]
    strides = _strides(shape)
    if not lead:
        return [(sum(s * st for (s, _), st in zip(dst, strides)), src)]
    if len(src) != len(dst) or box_shape(src) != box_shape(dst):
        return []
    # iterate the leading dims one index at a time (recursively), same index in src
    i = lead[0]
    out: list[tuple[int, Box]] = []
    for j in range(dst[i][1] - dst[i][0]):
        d = dst[:i] + ((dst[i][0] + j, dst[i][0] + j + 1),) + dst[i + 1:]
        s = src[:i] + ((src[i][0] + j, src[i][0] + j + 1),) + src[i + 1:]
        sub = _runs(d, s, shape)
        if not sub:
            return []
        out.extend(sub)
    return out


def source_tensor_of(tensors: dict[str, EngineTensor]) -> dict[str, str]:
    """For one holder rank: trainer parameter -> the engine tensor holding it (the buffer its
    shards offset into). LayoutError when one parameter sits in two engine tensors of one rank
    (one local buffer per parameter is the sender's contract)."""
    out: dict[str, str] = {}
    for tname in sorted(tensors):
        for p in tensors[tname].pieces:
            prev = out.setdefault(p.src, tname)
            if prev != tname:
                raise LayoutError(
                    f"parameter {p.src!r} is held in two engine tensors of one rank ({prev!r} and {tname!r}); "
                    "such an engine cannot be a reload source"
                )
    return out


def params_of(*layouts: dict[int, dict[str, EngineTensor]]) -> dict[str, ParamSpec]:
    """Full parameter shapes implied by engine pieces (the furthest end in every dim), dtype of
    the engine tensor. Every engine covers each parameter it reads, so the union is its shape."""
    ends: dict[str, list[int]] = {}
    dtypes: dict[str, str] = {}
    for layout in layouts:
        for tensors in layout.values():
            for t in tensors.values():
                for p in t.pieces:
                    e = ends.setdefault(p.src, [0] * len(p.src_box))
                    for i, (_, stop) in enumerate(p.src_box):
                        e[i] = max(e[i], stop)
                    dtypes.setdefault(p.src, t.dtype)
    return {n: ParamSpec(n, tuple(e), dtypes[n]) for n, e in sorted(ends.items())}


def local_shards(tensors: dict[str, EngineTensor], rank: int, holder: str = "holder") -> tuple[dict[str, list[Shard]], dict[str, str]]:
    """One holder rank's shards of every parameter it holds (offsets into the engine tensor that
    holds it) and that engine tensor's name per parameter: the ``shards=`` and the buffers of
    ``sources=`` a :class:`~fastsync.sync.sender.WeightSender` on that rank takes."""
    buffer_of = source_tensor_of(tensors)
    shards: dict[str, list[Shard]] = {}
    seen: set[tuple[str, Box]] = set()
    for tname in sorted(tensors):
        t = tensors[tname]
        for p in t.pieces:
            if p.transform != "copy":
                raise LayoutError(
                    f"{holder} engine rank {rank}: tensor {tname!r} holds parameter {p.src!r} through transform "
                    f"{p.transform!r}; only unquantised engines can be reload sources"
                )
            runs = _runs(p.dst_box, p.src_box, t.shape)
            if not runs:
                raise LayoutError(
                    f"{holder} engine rank {rank}: tensor {tname!r} holds parameter {p.src!r} box {p.src_box} at "
                    f"{p.dst_box}, not a contiguous run; it cannot be a reload source"
                )
            for off, sbox in runs:
                if (p.src, sbox) not in seen and box_numel(sbox) > 0:
                    seen.add((p.src, sbox))
                    shards.setdefault(p.src, []).append(Shard(rank, sbox, off))
    return shards, buffer_of


def engine_source_layout(holders: list[HolderRanks], params: dict[str, ParamSpec]) -> TrainerLayout:
    """The holders' engine ranks, end to end, as one source layout (kind ``"engine"``).
    Source rank ``offset_h + i`` is worker i of holder h (offsets in the order given)."""
    shards: dict[str, list[Shard]] = {}
    rank = 0
    for h in holders:
        for tensors in h.tensors:
            for tname, t in tensors.items():
                for p in t.pieces:
                    if p.src in params and params[p.src].dtype != t.dtype:
                        raise LayoutError(f"holder {h.holder}: tensor {tname!r} is {t.dtype}, parameter {p.src!r} "
                                          f"is {params[p.src].dtype} in the joining engine")
            got, _ = local_shards(tensors, rank, f"holder {h.holder}")
            for n, ss in got.items():
                shards.setdefault(n, []).extend(ss)
            rank += 1
    missing = sorted(set(params) - set(shards))
    if missing:
        raise LayoutError(f"holders {[h.holder for h in holders]} hold no part of parameter(s) {missing[:5]} the "
                          "joining engine needs")
    layout = TrainerLayout(rank, {n: params[n] for n in shards if n in params},
                           {n: tuple(s) for n, s in shards.items() if n in params}, kind="engine",
                           description="reload holders " + ", ".join(h.holder for h in holders))
    layout.validate()
    return layout


def target_layout(tensors: list[dict[str, EngineTensor]], description: str = "joining engine") -> EngineLayout:
    """The joining engine's workers as one EngineLayout (ranks 0..n-1, one replica)."""
    return EngineLayout(len(tensors), {i: t for i, t in enumerate(tensors)}, {i: 0 for i in range(len(tensors))},
                        kind="vllm", description=description)


def merge_sources(layouts: list[TrainerLayout], params: dict[str, ParamSpec]) -> TrainerLayout:
    """Several holders' source layouts (engine holders from :func:`engine_source_layout`,
    trainer jobs as they are) end to end: holder h's rank r becomes ``offset_h + r``. Only
    ``params`` (what the joining engine reads) are kept."""
    shards: dict[str, list[Shard]] = {}
    offset = 0
    for lay in layouts:
        for n, ss in lay.shards.items():
            if n in params:
                if lay.params[n].shape != params[n].shape:
                    raise LayoutError(f"holder layout {lay.description!r}: parameter {n!r} has shape "
                                      f"{lay.params[n].shape}, the joining engine reads {params[n].shape}")
                shards.setdefault(n, []).extend(Shard(s.rank + offset, s.box, s.local_offset) for s in ss)
        offset += lay.world_size
    missing = sorted(set(params) - set(shards))
    if missing:
        raise LayoutError(f"the holders hold no part of parameter(s) {missing[:5]} the joining engine needs")
    out = TrainerLayout(offset, dict(params), {n: tuple(s) for n, s in shards.items()}, kind="reload",
                        description=" + ".join(lay.description for lay in layouts))
    out.validate()
    return out
