"""The static transfer planner: (model inventory, trainer layout, engine layout) -> :class:`Plan`.

In order:

1. Validate: both layouts against the inventory (uncovered parameters, shapes that disagree,
   names that map to nothing, unknown transforms), raising before anything is planned.
2. For every engine piece on every engine rank, split its source box along the trainer's
   shard boundaries (a bisection in a per-parameter index, see ``plan/index.py``). Each part is
   sent by a rank that already holds it, sliced with no gather; its destination sub-box is the
   source sub-box mapped back through the piece. Block transforms (``fp8_block``/``fp8_scale``,
   128x128 blocks) are only cut at block boundaries; a piece whose blocks the trainer's shards
   cut, or whose transform cannot be sliced, is sent from an *owner* that gathers the whole
   parameter first (``Plan.gathers``; ``Transfer.gathered``), as FSDP's ``full_tensor()`` does.
   A piece that would be cut into many tiny parts (a replicated norm over 256 FSDP shards) is
   also sent whole from an owner: per-transfer costs would dominate its bytes.
3. Optionally split transfers over ``max_transfer_bytes`` into sub-boxes along their first
   non-unit dim, so the executor can pipeline chunks.
4. Balance: bytes a rank must send because only it holds them are fixed; every other choice
   (which replica sends a part, which rank owns a gathered parameter) is made greedily, largest
   first, to the candidate with the least bytes so far (ties: lowest rank). Receive bytes are
   fixed by the engine layout.

Deterministic: the same inputs give the same transfers in the same order, so the same
``plan_hash``. Pure Python (no torch), fast enough for Kimi-K2 on 256 -> 128 ranks.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Mapping

from fastsync.errors import LayoutError, PlanError
from fastsync.layout.box import Box, box_numel, box_shape
from fastsync.layout.types import DTYPE_BYTES, FP8_BLOCK, EngineLayout, ParamSpec, Piece, TrainerLayout
from fastsync.plan.fingerprint import engine_fingerprint, trainer_fingerprint
from fastsync.plan.index import ShardIndex, build_index, map_sub_box, scale_space
from fastsync.plan.relay import FANOUT_MODES, choose_fanout
from fastsync.plan.replicate import first_replica, replica_structure
from fastsync.plan.types import Plan, Transfer
from fastsync.plan.validate import validate_inputs

__all__ = ["build_plan", "transform_kind", "validate_inputs"]

#: Transforms the planner knows without asking the plugin registry: name -> block edge (0 means
#: elementwise, freely sliceable).
_BUILTIN_KINDS: dict[str, int] = {"copy": 0, "fp8_block": FP8_BLOCK, "fp8_scale": FP8_BLOCK}
#: Block edge meaning "whole piece only": the parameter is gathered onto an owner.
WHOLE = -1


def _transfer_factory():  # type: ignore[no-untyped-def]
    """``Transfer(*fields)`` without the frozen dataclass ``__init__`` (nine ``object.__setattr__``
    calls, a third of the planner's time on Kimi-K2): a fresh instance whose slots are set through
    their descriptors, equal to one built normally. Falls back to the class itself should the
    contract ever grow a ``__post_init__`` or change its fields."""
    names = [f.name for f in dataclasses.fields(Transfer)]
    if hasattr(Transfer, "__post_init__") or names != ["src_rank", "dst_rank", "dst_tensor", "dst_box", "src_param",
                                                       "src_box", "transform", "nbytes", "gathered"]:
        return Transfer
    s0, s1, s2, s3, s4, s5, s6, s7, s8 = (Transfer.__dict__[n].__set__ for n in names)
    new = object.__new__

    def make(a0, a1, a2, a3, a4, a5, a6, a7, a8):  # type: ignore[no-untyped-def]
        t = new(Transfer)
        s0(t, a0), s1(t, a1), s2(t, a2), s3(t, a3), s4(t, a4), s5(t, a5), s6(t, a6), s7(t, a7), s8(t, a8)
        return t

    return make


_make_transfer = _transfer_factory()


@dataclasses.dataclass(slots=True)
class _Pending:
    """A Transfer whose sender is not chosen yet: a part several trainer ranks hold, or part of a
    parameter gathered onto an owner. ``_assign`` fills in ``src_rank``."""

    src_rank: int
    dst_rank: int
    dst_tensor: str
    dst_box: Box
    src_param: str
    src_box: Box
    transform: str
    nbytes: int
    gathered: bool

    def transfer(self) -> Transfer:
        return _make_transfer(self.src_rank, self.dst_rank, self.dst_tensor, self.dst_box, self.src_param,
                              self.src_box, self.transform, self.nbytes, self.gathered)


def transform_kind(name: str) -> int:
    """0: elementwise (slice anywhere); n > 0: works on n x n blocks of the last two dims;
    ``WHOLE``: needs the whole piece. Unknown names are looked up in the plugin registry."""
    if name in _BUILTIN_KINDS:
        return _BUILTIN_KINDS[name]
    from fastsync import plugins

    reg = plugins.transforms().get(name)
    if reg is None:
        raise PlanError(f"unknown transform {name!r}; registered: {sorted(plugins.transforms())}")
    if reg.extra.get("elementwise"):
        return 0
    block = reg.extra.get("block")
    return int(block) if block else WHOLE


def _aligned(sub: Box, piece: Box, block: int) -> bool:
    """Every cut of ``sub`` inside ``piece`` on the block dims falls on a block boundary."""
    ndim = len(piece)
    for d in range(max(0, ndim - 2), ndim):
        p0, p1 = piece[d]
        a, b = sub[d][0] - p0, sub[d][1] - p0
        if a % block or (b % block and sub[d][1] != p1):
            return False
    return True


def _dst_sub(sub: Box, piece_src: Box, piece_dst: Box, block: int, is_scale: bool) -> Box:
    if sub == piece_src:
        return piece_dst
    if is_scale:
        rel, ext = scale_space(sub, piece_src, block)
    else:
        rel = tuple((s0 - p0, s1 - p0) for (s0, s1), (p0, _) in zip(sub, piece_src))
        ext = box_shape(piece_src)
    return map_sub_box(rel, ext, piece_dst)


def _split(sub: Box, piece_src: Box, block: int, max_elems: int) -> list[Box]:
    """Cut ``sub`` along its first non-unit dim into parts of at most ``max_elems`` elements
    (at block boundaries relative to the piece corner when that dim is a block dim)."""
    n = box_numel(sub)
    if n <= max_elems:
        return [sub]
    ndim = len(sub)
    dim = next((d for d, (a, b) in enumerate(sub) if b - a > 1), None)
    if dim is None:
        return [sub]
    s0, s1 = sub[dim]
    row = n // (s1 - s0)
    step = max(1, max_elems // row)
    if block > 0 and dim >= ndim - 2:
        step = max(block, step // block * block)
        # keep cuts on the piece's block grid: the first cut aligns to the grid
        off = (s0 - piece_src[dim][0]) % block
        assert off == 0, (sub, piece_src)
    if step >= s1 - s0:
        return [sub]
    out = []
    for a in range(s0, s1, step):
        out.append(sub[:dim] + ((a, min(a + step, s1)),) + sub[dim + 1:])
    return out


def _piece_parts(
    p: Piece,
    idx: ShardIndex,
    cache: dict[tuple[Box, int, int], list[tuple[Box, tuple[int, ...]]] | None],
    block: int,
    elem_bytes: int,
    src_bytes: int,
    max_transfer_bytes: int | None,
    min_transfer_bytes: int,
    coalesce_min_parts: int,
) -> tuple[bool, list[tuple[Box, Box, int, tuple[int, ...]]]]:
    """How one piece is sent: (needs the owner gather, [(src sub-box, dst sub-box, bytes,
    ranks that hold the sub-box)])."""
    is_scale = p.transform == "fp8_scale"
    key = (p.src_box, block, src_bytes)  # the coalescing choice depends on the source dtype
    parts = cache.get(key, ...)
    if parts is ...:
        k = idx.count(p.src_box)
        if k >= coalesce_min_parts and box_numel(p.src_box) * src_bytes < min_transfer_bytes * k:
            if not idx.complete:
                idx.decompose(p.src_box)  # still refuse holes
            parts = None
        else:
            parts = idx.decompose(p.src_box)
            if block == WHOLE and len(parts) > 1:
                parts = None
            elif block > 0 and not all(_aligned(sub, p.src_box, block) for sub, _ in parts):
                parts = None
        cache[key] = parts
    max_elems = None if max_transfer_bytes is None or is_scale else max(1, max_transfer_bytes // elem_bytes)
    out = []
    if parts is None:
        subs = [p.src_box] if max_elems is None or block < 0 else _split(p.src_box, p.src_box, block, max_elems)
        for sub in subs:
            dst = _dst_sub(sub, p.src_box, p.dst_box, block, is_scale)
            out.append((sub, dst, box_numel(dst) * elem_bytes, ()))
        return True, out
    for sub, holders in parts:
        for s in [sub] if max_elems is None else _split(sub, p.src_box, block, max_elems):
            dst = _dst_sub(s, p.src_box, p.dst_box, block, is_scale)
            out.append((s, dst, box_numel(dst) * elem_bytes, holders))
    return False, out


def build_plan(
    params: Mapping[str, ParamSpec],
    trainer: TrainerLayout,
    engine: EngineLayout,
    *,
    max_transfer_bytes: int | None = None,
    min_transfer_bytes: int = 64 << 10,
    coalesce_min_parts: int = 8,
    allow_unread: bool | Collection[str] = False,
    fanout: str = "off",
) -> Plan:
    """Compute the static schedule. See the module docstring for the order of work.

    ``min_transfer_bytes`` / ``coalesce_min_parts``: a piece the trainer's shards would cut into
    ``coalesce_min_parts`` or more parts averaging under ``min_transfer_bytes`` of source (a
    norm or router weight replicated on every engine rank, FSDP-sharded 256 ways) is sent whole
    from a gather owner instead: one transfer per receiver, not hundreds of tiny ones. Set
    ``min_transfer_bytes=0`` to always slice.

    ``allow_unread``: a parameter no engine piece reads is an error (nothing is silently
    skipped) unless this is True or names it (e.g. ``{"lm_head.weight"}`` when the engine ties
    it to the embedding); unread parameters are listed in ``plan.meta["unread_params"]``.

    ``fanout``: ``off`` plans every engine rank. Otherwise, when the engine is ``R`` identical
    replicas (``plan/replicate.py``), only the first is planned and ``plan.fanout`` says how the
    others get its transfers (``plan/relay.py``): ``direct`` (all from trainer ranks), ``auto``
    (direct, relayed by engine ranks, or a mix, from the cost model) or ``chain`` (every byte leaves
    its trainer rank once). Planning cost is then flat in ``R``.

    Raises LayoutError/PlanError before anything is planned.
    """
    if max_transfer_bytes is not None and max_transfer_bytes <= 0:
        raise PlanError(f"max_transfer_bytes must be positive, got {max_transfer_bytes}")
    if fanout not in FANOUT_MODES:
        raise PlanError(f"fanout must be one of {FANOUT_MODES}, got {fanout!r}")
    validate_inputs(params, trainer, engine)
    full = engine
    structure = replica_structure(engine) if fanout != "off" else None
    if structure is not None:
        engine = first_replica(engine, structure[0])

    # Group the engine's pieces by the parameter they read, in a fixed order.
    by_param: dict[str, list[tuple[int, str, str, object]]] = {name: [] for name in params}
    kinds: dict[str, int] = {}
    for rank in sorted(engine.tensors):
        tensors = engine.tensors[rank]
        for tname in sorted(tensors):
            t = tensors[tname]
            for p in t.pieces:
                if p.transform not in kinds:
                    try:
                        kinds[p.transform] = transform_kind(p.transform)
                    except PlanError as e:
                        raise PlanError(f"engine rank {rank} tensor {tname!r}: {e}") from None
                by_param[p.src].append((rank, tname, t.dtype, p))
    unread = [n for n, ps in by_param.items() if not ps]
    refused = [n for n in unread if not (allow_unread is True or (allow_unread and n in allow_unread))]
    if refused:
        unread = refused
        raise PlanError(
            f"{len(unread)} parameter(s) are read by no engine tensor, e.g. {unread[:3]}: "
            "fix the name map or pass allow_unread=True"
        )

    # One pass over the pieces. Parts only one rank holds become Transfers at once; the others
    # (several holders, or sent by a gather owner) wait as lists for _assign to pick a sender.
    load = [0] * trainer.world_size
    ordered: list[Transfer | _Pending] = []  # model order: parameter by parameter, engine ranks ascending
    choosable: list[tuple[_Pending, tuple[int, ...]]] = []
    gathered: dict[str, list[_Pending]] = {}
    indices: dict[str, ShardIndex] = {}
    # FSDP builders share one shard tuple between same-shaped parameters: index it once
    shared: dict[tuple[int, tuple[int, ...]], tuple[ShardIndex, dict]] = {}
    for name, plist in by_param.items():
        if not plist:
            continue
        spec = params[name]
        shards = trainer.shards[name]
        hit = shared.get((id(shards), spec.shape))
        if hit is None:
            hit = shared[(id(shards), spec.shape)] = (build_index(name, tuple(spec.shape), shards), {})
        idx = dataclasses.replace(hit[0], name=name) if hit[0].name != name else hit[0]
        cache = hit[1]
        indices[name] = idx
        # replicas share piece objects: a piece's parts are worked out once per dtype
        pcache: dict[tuple[int, str], tuple[bool, list[tuple[Box, Box, int, tuple[int, ...]]]]] = {}
        src_bytes = DTYPE_BYTES[spec.dtype]
        for rank, tname, dtype, p in plist:
            res = pcache.get((id(p), dtype))
            if res is None:
                res = pcache[(id(p), dtype)] = _piece_parts(
                    p, idx, cache, kinds[p.transform], DTYPE_BYTES[dtype], src_bytes,
                    max_transfer_bytes, min_transfer_bytes, coalesce_min_parts)
            is_gather, parts = res
            tf = p.transform
            for sub, dst, nbytes, holders in parts:
                if is_gather:
                    it = _Pending(-1, rank, tname, dst, name, sub, tf, nbytes, True)
                    gathered.setdefault(name, []).append(it)
                    ordered.append(it)
                elif len(holders) == 1:
                    load[holders[0]] += nbytes
                    ordered.append(_make_transfer(holders[0], rank, tname, dst, name, sub, tf, nbytes, False))
                else:
                    it = _Pending(-1, rank, tname, dst, name, sub, tf, nbytes, False)
                    choosable.append((it, holders))
                    ordered.append(it)

    gathers = _assign(load, choosable, gathered, indices)
    transfers = [t.transfer() if type(t) is _Pending else t for t in ordered]
    meta = {
        "planner": "fastsync.plan.planner/1",
        "trainer_kind": trainer.kind,
        "engine_kind": engine.kind,
        "max_transfer_bytes": max_transfer_bytes,
        "unread_params": unread,
        "gather_sources": _gather_sources(gathers, indices, params),
        "model_bytes": sum(p.nbytes for p in params.values()),
        "owner_unique_bytes": _owner_unique_bytes(by_param, indices, params, trainer.world_size),
    }
    fan = None
    if structure is not None:
        fan = choose_fanout(transfers, trainer.world_size, structure[0], structure[1], fanout)
        meta["fanout_mode"] = fanout
    return Plan(transfers, gathers, trainer_fingerprint(trainer), engine_fingerprint(full), trainer.world_size,
                full.world_size, meta, fan, _padded(engine))


def _padded(engine: EngineLayout) -> dict[int, dict[str, tuple[tuple[int, ...], tuple[int, ...]]]]:
    """Both shapes of every tensor the engine pads, per planned engine rank (ranks share dicts)."""
    per_dict: dict[int, dict[str, tuple[tuple[int, ...], tuple[int, ...]]]] = {}
    out: dict[int, dict[str, tuple[tuple[int, ...], tuple[int, ...]]]] = {}
    for rank, ts in engine.tensors.items():
        got = per_dict.get(id(ts))
        if got is None:
            got = per_dict[id(ts)] = {n: (tuple(t.logical_shape), tuple(t.shape)) for n, t in ts.items()
                                      if t.logical_shape is not None}
        if got:
            out[rank] = got
    return out


def _owner_unique_bytes(by_param: Mapping[str, list], indices: dict[str, ShardIndex],
                        params: Mapping[str, ParamSpec], world: int) -> list[int]:
    """Bytes each trainer rank must send at least once under any schedule: the elements of
    parameters the engine reads that only it holds, in the narrowest dtype an engine tensor takes
    them in (an owner may cast or quantise before sending). The physical lower bound's sender side."""
    out = [0] * world
    per_index: dict[int, list[tuple[int, int]]] = {}  # builders share shard boxes between parameters
    for name, idx in indices.items():
        readers = by_param.get(name)
        if not readers:
            continue
        elem = min(DTYPE_BYTES[dtype] for _, _, dtype, _ in readers)
        owned = per_index.get(id(idx.boxes))
        if owned is None:
            owned = per_index[id(idx.boxes)] = [(holders[0], box_numel(box))
                                                for box, holders in zip(idx.boxes, idx.holders) if len(holders) == 1]
        for rank, numel in owned:
            out[rank] += numel * elem
    return out


def _assign(load: list[int], choosable: list[tuple[_Pending, tuple[int, ...]]], gathered: dict[str, list[_Pending]],
            indices: dict[str, ShardIndex]) -> dict[str, int]:
    """Choose the sender of each part several ranks hold, and the owner of each gathered
    parameter (any rank holding part of it), balancing send bytes: largest first, to the
    candidate with the least bytes so far (ties: lowest rank). ``load`` starts with the bytes
    only one rank can send. Fills in the senders; returns the owners."""
    units: list[tuple[int, int, _Pending | str, tuple[int, ...]]] = []  # (-bytes, order, what, candidates)
    for i, (it, holders) in enumerate(choosable):
        units.append((-it.nbytes, i, it, holders))
    base = len(units)
    for j, (name, its) in enumerate(gathered.items()):
        units.append((-sum(it.nbytes for it in its), base + j, name, indices[name].ranks))
    units.sort(key=lambda u: (u[0], u[1]))
    gathers: dict[str, int] = {}
    for neg, _, what, cands in units:
        best = min(cands, key=lambda r: (load[r], r))
        load[best] -= neg
        if isinstance(what, str):
            gathers[what] = best
            for it in gathered[what]:
                it.src_rank = best
        else:
            what.src_rank = best
    return dict(sorted(gathers.items()))


def _gather_sources(gathers: dict[str, int], indices: dict[str, ShardIndex],
                    params: Mapping[str, ParamSpec]) -> dict[str, list[list[int]]]:
    """For each gathered parameter: ``[[rank, bytes], ...]`` the owner pulls in (one holder per
    distinct shard box: the owner itself when it holds it, else the replica nearest in rank
    number, i.e. on its node or in its HSDP group when ranks are laid out that way), for the
    simulator's gather cost."""
    out: dict[str, list[list[int]]] = {}
    for name, owner in gathers.items():
        idx = indices[name]
        elem = DTYPE_BYTES[params[name].dtype]
        per: dict[int, int] = {}
        shape = params[name].shape
        inner = math.prod(shape) // shape[idx.dim] if idx.slab and shape[idx.dim] else 0
        for box, holders, start, stop in zip(idx.boxes, idx.holders, idx.starts, idx.stops):
            if owner in holders:
                continue
            r = holders[0] if len(holders) == 1 else min(holders, key=lambda h: (abs(h - owner), h))
            per[r] = per.get(r, 0) + ((stop - start) * inner if idx.slab else box_numel(box)) * elem
        out[name] = [[r, b] for r, b in sorted(per.items())]
    return out
