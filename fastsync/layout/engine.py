"""Engine layouts: which engine tensors each engine rank holds, and which trainer bytes fill them.

Two entry points over a model's inventory and name map:

* :func:`engine_tensors_for_rank` — the tensors ONE vLLM worker holds, from its parallel
  coordinates; used inside a live worker by the receiver to find its parameters' pieces.
* :func:`build_engine_layout` — every rank of ``replicas`` engines, for planning without a
  cluster. Ranks are numbered ``replica * (tp * dp) + dp_rank * tp + tp_rank``.

How vLLM 0.32 splits an engine of ``tp`` x ``dp`` ranks (read from
``FusedMoEParallelConfig.make`` and ``determine_expert_map``):

* dense and attention weights: tensor parallel over ``tp``, replicated over ``dp``;
* routed experts without expert parallel: tensor parallel over all ``tp * dp`` ranks
  (``flatten_tp_across_dp``), every rank holds a slice of every expert;
* routed experts with ``enable_expert_parallel``: the EP group is all ``tp * dp`` ranks
  (ep_rank = dp_rank * tp + tp_rank), each holds whole experts, placed linearly (the first
  ``E % ep`` ranks take one extra).

With ``quant="fp8"`` (block FP8 as DeepSeek-V3 checkpoints and vLLM's ``Fp8LinearMethod`` use)
every quantisable linear weight becomes ``float8_e4m3fn`` filled by ``fp8_block`` pieces, plus a
float32 ``<name>_scale_inv`` tensor (``weight`` -> ``weight_scale_inv``, ``w13_weight`` ->
``w13_weight_scale_inv``) of shape ``[..., ceil(out/128), ceil(in/128)]`` filled by ``fp8_scale``
pieces whose ``dst_box`` is in scale coordinates and whose ``src_box`` is the trainer region the
scales cover. Fused MoE weights count blocks per part (gate, up), as vLLM does.
"""

from __future__ import annotations

import bisect

from fastsync.errors import ConfigError, LayoutError
from fastsync.layout.box import Box, intersect, matching_box
from fastsync.layout.namemap import EngineParam, NameMap, Segment
from fastsync.layout.padding import DimPad, pad_tensor, round_up
from fastsync.layout.types import DTYPE_BYTES, FP8_BLOCK, EngineLayout, EngineTensor, Piece

__all__ = [
    "VOCAB_PADDING",
    "FP8_BLOCK",
    "engine_tensors_for_rank",
    "vllm_rank_coords",
    "build_engine_layout",
    "expert_range",
    "scale_name",
    "padded_vocab",
    "rank_intervals",
    "rank_pieces",
]

VOCAB_PADDING = 64
QUANTS = (None, "fp8")


def padded_vocab(vocab: int, pad_to: int = VOCAB_PADDING) -> int:
    """vLLM's ``pad_vocab_size``: the vocab rounded up to a multiple of ``pad_to``."""
    return -(-vocab // pad_to) * pad_to


def expert_range(num_experts: int, ep_size: int, ep_rank: int) -> tuple[int, int]:
    """The experts ``[start, stop)`` vLLM's linear placement gives EP rank ``ep_rank``."""
    base, rem = divmod(num_experts, ep_size)
    start = ep_rank * base + min(ep_rank, rem)
    return start, start + base + (1 if ep_rank < rem else 0)


def scale_name(name: str) -> str:
    """vLLM's block-FP8 scale parameter name for weight ``name``."""
    if name.endswith(".weight"):
        return name[: -len(".weight")] + ".weight_scale_inv"
    return name + "_scale_inv"


def _split(size: int, parts: int, rank: int, what: str) -> tuple[int, int]:
    if size % parts:
        raise LayoutError(f"{what}: dim of size {size} does not split evenly over {parts} ranks")
    step = size // parts
    return rank * step, (rank + 1) * step


def _head_split(size: int, heads: int, tp: int, rank: int, what: str) -> tuple[int, int]:
    """vLLM's head-granular split: whole heads per rank, heads replicated when fewer than ranks."""
    if size % heads:
        raise LayoutError(f"{what}: {size} rows are not {heads} whole heads")
    hs = size // heads
    if heads >= tp:
        if heads % tp:
            raise LayoutError(f"{what}: {heads} heads do not split over tensor parallel size {tp}")
        per = heads // tp
        return rank * per * hs, (rank + 1) * per * hs
    if tp % heads:
        raise LayoutError(f"{what}: tensor parallel size {tp} is not a multiple of its {heads} heads (vLLM refuses)")
    head = rank // (tp // heads)
    return head * hs, (head + 1) * hs


def _intervals(ep: EngineParam, tp: int, tp_rank: int, ep_size: int, ep_rank: int,
               vocab_pad: int = VOCAB_PADDING) -> list[list[tuple[int, int]]] | None:
    """Per dim, the ordered global intervals whose concatenation is this rank's local tensor.
    None when the rank holds nothing of it (a vocab slice that is all padding)."""
    iv = [[(0, n)] for n in ep.shape]
    if ep.expert_dim is not None and ep_size > 1:
        e0, e1 = expert_range(ep.shape[ep.expert_dim], ep_size, ep_rank)
        if e1 <= e0:
            return None
        iv[ep.expert_dim] = [(e0, e1)]
    what = f"engine tensor {ep.name!r}"
    if ep.style == "replicated" or tp == 1 and ep.style != "vocab":
        return iv
    d = ep.shard_dim
    if ep.style == "column":
        out, off = [], 0
        for part in ep.parts:
            if part.heads:
                a, b = _head_split(part.size, part.heads, tp, tp_rank, what)
            else:
                a, b = _split(part.size, tp, tp_rank, what)
            out.append((off + a, off + b))
            off += part.size
        iv[d] = out
    elif ep.style == "row":
        iv[d] = [_split(ep.shape[d], tp, tp_rank, what)]
    elif ep.style == "vocab":
        padded = padded_vocab(ep.shape[d], vocab_pad)
        if padded % tp:
            raise LayoutError(f"{what}: padded vocab {padded} does not split over {tp} ranks")
        per = padded // tp
        a, b = tp_rank * per, min((tp_rank + 1) * per, ep.shape[d])
        if b <= a:
            return None
        iv[d] = [(a, b)]
    return iv


def rank_intervals(ep: EngineParam, *, tp: int, tp_rank: int, ep_size: int = 1, ep_rank: int = 0,
                   vocab_pad: int = VOCAB_PADDING) -> list[list[tuple[int, int]]] | None:
    """Per dim, the global intervals of ``ep`` whose concatenation is rank ``tp_rank``'s local
    tensor (None: the rank holds none of it). Used to map a rank's recorded layout back to full
    coordinates (``fastsync.engines.vllm.recorded_map``) and a trainer's pieces to the engine
    ranks that hold them (``fastsync.layout.trainer``: Megatron pads the vocabulary to
    ``vocab_pad``)."""
    return _intervals(ep, tp, tp_rank, ep_size, ep_rank, vocab_pad)


def _src_box(seg: Segment, inter: Box) -> Box:
    """The trainer box holding the same elements as ``inter`` (a sub-box of ``seg.dst_box``)."""
    return matching_box(seg.dst_box, seg.src_box, inter)


_SEG_INDEX: dict[int, tuple[tuple[Segment, ...], list[int] | None]] = {}


def _expert_segments(ep: EngineParam, experts: tuple[int, int]) -> tuple[Segment, ...] | list[Segment]:
    """The segments of ``ep`` touching experts ``[e0, e1)``: a bisect over segment starts along
    the expert dim when they are sorted (per-expert name maps list them in expert order)."""
    segs, ed = ep.segments, ep.expert_dim
    assert ed is not None
    got = _SEG_INDEX.get(id(segs))
    if got is None or got[0] is not segs:
        starts = [s.dst_box[ed][0] for s in segs]
        sorted_ok = all(a <= b for a, b in zip(starts, starts[1:])) and all(s.dst_box[ed][1] - s.dst_box[ed][0] == 1 for s in segs)
        if len(_SEG_INDEX) > 4096:
            _SEG_INDEX.clear()
        got = _SEG_INDEX[id(segs)] = (segs, starts if sorted_ok else None)
    e0, e1 = experts
    starts = got[1]
    if starts is None:
        return [s for s in segs if s.dst_box[ed][0] < e1 and s.dst_box[ed][1] > e0]
    return segs[bisect.bisect_left(starts, e0):bisect.bisect_left(starts, e1)]


def rank_pieces(ep: EngineParam, iv: list[list[tuple[int, int]]]) -> tuple[tuple[int, ...], list[Piece]]:
    """The local shape of the rank whose intervals are ``iv`` (:func:`rank_intervals`) and the
    pieces of ``ep``'s segments that land in it, in local coordinates."""
    shape = tuple(sum(b - a for a, b in dim) for dim in iv)
    multi = [d for d, dim in enumerate(iv) if len(dim) > 1]
    assert len(multi) <= 1, (ep.name, iv)
    cells: list[tuple[Box, tuple[int, ...]]] = []  # (global cell, local origin)
    base = tuple(dim[0] for dim in iv)
    if not multi:
        cells.append((base, (0,) * len(iv)))
    else:
        d = multi[0]
        off = 0
        for a, b in iv[d]:
            cell = base[:d] + ((a, b),) + base[d + 1 :]
            origin = tuple(off if k == d else 0 for k in range(len(iv)))
            cells.append((cell, origin))
            off += b - a
    segments = ep.segments
    if ep.expert_dim is not None and len(segments) > 8:  # per-expert sources: keep this rank's experts
        segments = _expert_segments(ep, iv[ep.expert_dim][0])
    pieces: list[Piece] = []
    for cell, origin in cells:
        for seg in segments:
            inter = intersect(cell, seg.dst_box)
            if inter is None:
                continue
            dst = tuple((i0 - c0 + o, i1 - c0 + o) for (i0, i1), (c0, _), o in zip(inter, cell, origin))
            pieces.append(Piece(dst, seg.src, _src_box(seg, inter)))
    return shape, pieces


def _scale_map(ep: EngineParam, iv: list[list[tuple[int, int]]], shape: tuple[int, ...]) -> tuple[int, list[tuple[int, int, int]]]:
    """Scale rows along the output dim (-2): total, and per local segment
    (local_start, local_stop, scale_start). Fused MoE weights count blocks per part."""
    out_dim = len(shape) - 2
    if ep.expert_dim is not None and ep.style == "column" and len(iv[out_dim]) > 1:
        rows, segs, local = 0, [], 0
        for a, b in iv[out_dim]:
            segs.append((local, local + b - a, rows))
            rows += -(-(b - a) // FP8_BLOCK)
            local += b - a
        return rows, segs
    n = shape[out_dim]
    return -(-n // FP8_BLOCK), [(0, n, 0)]


def _quantize(ep: EngineParam, iv: list[list[tuple[int, int]]], shape: tuple[int, ...], pieces: list[Piece]) -> tuple[EngineTensor, EngineTensor]:
    if len(shape) < 2:
        raise LayoutError(f"engine tensor {ep.name!r}: FP8 block quantisation needs a 2-D weight, got shape {shape}")
    out_dim, in_dim = len(shape) - 2, len(shape) - 1
    rows, segs = _scale_map(ep, iv, shape)
    cols = -(-shape[in_dim] // FP8_BLOCK)
    wpieces, spieces = [], []
    for p in pieces:
        (r0, r1), (c0, c1) = p.dst_box[out_dim], p.dst_box[in_dim]
        seg = next(s for s in segs if s[0] <= r0 < s[1])
        if r1 > seg[1] or (r0 - seg[0]) % FP8_BLOCK or ((r1 - seg[0]) % FP8_BLOCK and r1 != seg[1]) or c0 % FP8_BLOCK or (
            c1 % FP8_BLOCK and c1 != shape[in_dim]
        ):
            raise LayoutError(
                f"engine tensor {ep.name!r}: FP8 {FP8_BLOCK}x{FP8_BLOCK} blocks would straddle trainer parameter "
                f"{p.src!r} (local rows {r0}:{r1}, cols {c0}:{c1}); vLLM refuses this block shape too"
            )
        s_rows = (seg[2] + (r0 - seg[0]) // FP8_BLOCK, seg[2] + -(-(r1 - seg[0]) // FP8_BLOCK))
        s_cols = (c0 // FP8_BLOCK, -(-c1 // FP8_BLOCK))
        wpieces.append(Piece(p.dst_box, p.src, p.src_box, "fp8_block"))
        spieces.append(Piece(p.dst_box[:out_dim] + (s_rows, s_cols), p.src, p.src_box, "fp8_scale"))
    w = EngineTensor(ep.name, shape, "float8_e4m3fn", tuple(wpieces))
    sname = scale_name(ep.name)
    s = EngineTensor(sname, shape[:out_dim] + (rows, cols), "float32", tuple(spieces))
    return w, s


def _check(tp: int, tp_rank: int, ep_size: int, ep_rank: int, dp: int, dp_rank: int, dtype: str, quant: str | None) -> None:
    for name, size, rank in (("tp", tp, tp_rank), ("ep", ep_size, ep_rank), ("dp", dp, dp_rank)):
        if size < 1 or not 0 <= rank < size:
            raise ConfigError(f"{name} rank {rank} outside {name} size {size}")
    if dtype not in DTYPE_BYTES:
        raise ConfigError(f"engine dtype {dtype!r} unknown; known: {sorted(DTYPE_BYTES)}")
    if quant not in QUANTS:
        raise ConfigError(f"quant {quant!r} unknown; known: {QUANTS}")


def _engine_pads(ep: EngineParam, tp: int, shape: tuple[int, ...], moe_pad: int | None) -> list[DimPad]:
    """How vLLM pads this rank's tensor of ``shape`` (see ``layout/padding.py``): the vocabulary
    to ``padded_vocab / tp`` rows on every rank; with ``moe_pad``, each part of a fused-MoE
    tensor's intermediate dim to a multiple of it (vLLM CPU's kernels: 32)."""
    if ep.style == "vocab":
        d = ep.shard_dim
        return [DimPad(d, 1, shape[d], padded_vocab(ep.shape[d]) // tp)]
    if moe_pad and ep.expert_dim is not None and ep.style in ("column", "row"):
        d = ep.shard_dim
        parts = max(len(ep.parts), 1) if ep.style == "column" else 1
        if shape[d] % parts:
            raise LayoutError(f"engine tensor {ep.name!r}: {shape[d]} rows are not {parts} equal parts to pad")
        part = shape[d] // parts
        return [DimPad(d, parts, part, round_up(part, moe_pad))]
    return []


def _tensors_for_param(ep: EngineParam, tp: int, tp_rank: int, ep_size: int, ep_rank: int,
                       dtype: str, quant: str | None, moe_pad: int | None = None) -> list[EngineTensor]:
    iv = _intervals(ep, tp, tp_rank, ep_size, ep_rank)
    if iv is None:
        if ep.style != "vocab":
            return []
        # a vocab slice that is all padding: vLLM still allocates the rank's padded rows, none logical
        d = ep.shard_dim
        shape = tuple(0 if k == d else n for k, n in enumerate(ep.shape))
        t = EngineTensor(ep.name, shape, ep.dtype or dtype, ())
        return [pad_tensor(t, _engine_pads(ep, tp, shape, moe_pad))]
    shape, pieces = rank_pieces(ep, iv)
    if quant == "fp8" and ep.quantizable:
        if moe_pad and ep.expert_dim is not None:
            raise ConfigError(f"engine tensor {ep.name!r}: padded FP8 MoE weights (moe_pad={moe_pad}) are not modelled")
        return list(_quantize(ep, iv, shape, pieces))
    t = EngineTensor(ep.name, shape, ep.dtype or dtype, tuple(pieces))
    return [pad_tensor(t, _engine_pads(ep, tp, shape, moe_pad))]


def engine_tensors_for_rank(inventory: object, name_map: NameMap, *, tp_size: int, tp_rank: int,
                            ep_size: int = 1, ep_rank: int = 0, dp_size: int = 1, dp_rank: int = 0,
                            dtype: str = "bfloat16", quant: str | None = None,
                            moe_pad: int | None = None) -> dict[str, EngineTensor]:
    """The engine-local tensors one vLLM worker holds: local shapes and dtypes, pieces with
    ``dst_box`` in local coordinates and ``src_box`` in full trainer coordinates.

    ``ep_size``/``ep_rank``: vLLM's expert-parallel group (``tp * dp`` ranks of the engine when
    expert parallel is on; 1 otherwise). ``dp_size``/``dp_rank``: vLLM's data-parallel coordinates;
    without expert parallel they widen the MoE tensor parallelism to ``tp * dp`` as vLLM does.
    ``inventory`` is accepted for symmetry with the planner (the name map already holds shapes).
    Shapes are the engine's: the vocabulary padded as vLLM pads it, and with ``moe_pad`` the
    fused-MoE intermediate size per partition rounded up to a multiple of it (``logical_shape``
    keeps the name map's; see ``layout/padding.py``).
    """
    _check(tp_size, tp_rank, ep_size, ep_rank, dp_size, dp_rank, dtype, quant)
    _check_moe_pad(moe_pad)
    moe_tp, moe_rank = (1, 0) if ep_size > 1 else (tp_size * dp_size, dp_rank * tp_size + tp_rank)
    out: dict[str, EngineTensor] = {}
    for ep in name_map.params:
        if ep.expert_dim is not None:
            ts = _tensors_for_param(ep, moe_tp, moe_rank, ep_size, ep_rank, dtype, quant, moe_pad)
        else:
            ts = _tensors_for_param(ep, tp_size, tp_rank, 1, 0, dtype, quant)
        for t in ts:
            out[t.name] = t
    return out


def _check_moe_pad(moe_pad: int | None) -> None:
    if moe_pad is not None and (isinstance(moe_pad, bool) or not isinstance(moe_pad, int) or not 1 <= moe_pad <= 4096):
        raise ConfigError(f"moe_pad must be an integer in 1..4096 (vLLM CPU pads to 32), got {moe_pad!r}")


def vllm_rank_coords(*, tp_size: int, tp_rank: int, dp_size: int = 1, dp_rank: int = 0,
                     enable_expert_parallel: bool = False) -> dict[str, int]:
    """The keyword arguments of :func:`engine_tensors_for_rank` for a vLLM worker, from the
    values a worker knows (its TP/DP coordinates and ``enable_expert_parallel``), following
    ``FusedMoEParallelConfig.make``: the EP group is all ``tp * dp`` ranks of the engine."""
    use_ep = enable_expert_parallel and tp_size * dp_size > 1
    return {
        "tp_size": tp_size,
        "tp_rank": tp_rank,
        "dp_size": dp_size,
        "dp_rank": dp_rank,
        "ep_size": tp_size * dp_size if use_ep else 1,
        "ep_rank": dp_rank * tp_size + tp_rank if use_ep else 0,
    }


def build_engine_layout(inventory: object, name_map: NameMap, *, tp: int, ep: int | bool = 1, dp: int | None = None,
                        replicas: int = 1, dtype: str = "bfloat16", quant: str | None = None,
                        validate: bool = True, moe_pad: int | None = None) -> EngineLayout:
    """Every rank of ``replicas`` identical vLLM engines of ``tp * dp`` ranks each.

    ``ep``: 1/False = no expert parallel; True or ``tp * dp`` = vLLM's ``enable_expert_parallel``
    (the EP group is the whole engine). With ``dp`` omitted, ``ep=E`` implies ``dp = E // tp``
    (so ``tp=8, ep=32`` is one engine of 32 ranks). Any other value is a ConfigError: vLLM has
    no EP group of another size. Ranks holding identical tensors share the same dict objects (replicas, and ranks
    that differ only in coordinates a tensor does not depend on share EngineTensor objects).
    ``moe_pad``: as for :func:`engine_tensors_for_rank` (None: the MoE kernels do not pad).
    """
    _check_moe_pad(moe_pad)
    if dp is None:
        if isinstance(ep, int) and not isinstance(ep, bool) and ep > 1:
            if not isinstance(tp, int) or tp < 1 or ep % tp:
                raise ConfigError(
                    f"engine layout: ep={ep} is not a multiple of tp={tp}; vLLM's expert-parallel group is the "
                    f"whole engine (tp x data-parallel ranks), so ep must be tp x dp"
                )
            dp = ep // tp
        else:
            dp = 1
    for name, v in (("tp", tp), ("dp", dp), ("replicas", replicas)):
        if not isinstance(v, int) or v < 1:
            raise ConfigError(f"engine layout: {name} must be a positive integer, got {v!r}")
    engine_size = tp * dp
    if ep is True:
        ep_size = engine_size if engine_size > 1 else 1
    elif ep is False or ep == 1:
        ep_size = 1
    elif isinstance(ep, int) and ep == engine_size:
        ep_size = ep
    else:
        raise ConfigError(
            f"engine layout: ep={ep!r} but vLLM's expert-parallel group is the whole engine, tp*dp = {engine_size} "
            f"ranks; use ep={engine_size} (or ep=1 for none) and replicas=N for more engines"
        )
    _check(tp, 0, ep_size, 0, dp, 0, dtype, quant)
    moe_tp = 1 if ep_size > 1 else engine_size
    dense_cache: dict[int, list[EngineTensor]] = {}
    expert_cache: dict[int, list[EngineTensor]] = {}
    dense = [p for p in name_map.params if p.expert_dim is None]
    experts = [p for p in name_map.params if p.expert_dim is not None]
    per_rank: list[dict[str, EngineTensor]] = []
    for dp_rank in range(dp):
        for tp_rank in range(tp):
            if tp_rank not in dense_cache:
                dense_cache[tp_rank] = [t for p in dense for t in _tensors_for_param(p, tp, tp_rank, 1, 0, dtype, quant)]
            flat = dp_rank * tp + tp_rank
            if flat not in expert_cache:
                if ep_size > 1:
                    expert_cache[flat] = [t for p in experts
                                          for t in _tensors_for_param(p, 1, 0, ep_size, flat, dtype, quant, moe_pad)]
                else:
                    expert_cache[flat] = [t for p in experts
                                          for t in _tensors_for_param(p, moe_tp, flat, 1, 0, dtype, quant, moe_pad)]
            rank_tensors = {t.name: t for t in dense_cache[tp_rank]}
            rank_tensors.update((t.name, t) for t in expert_cache[flat])
            per_rank.append(rank_tensors)
    tensors: dict[int, dict[str, EngineTensor]] = {}
    replica_of: dict[int, int] = {}
    for r in range(replicas):
        for i, ts in enumerate(per_rank):
            rank = r * engine_size + i
            tensors[rank] = ts
            replica_of[rank] = r
    desc = f"vllm tp={tp} dp={dp} ep={ep_size} replicas={replicas} dtype={dtype} quant={quant}" + (
        f" moe_pad={moe_pad}" if moe_pad else "")
    layout = EngineLayout(world_size=engine_size * replicas, tensors=tensors, replica_of=replica_of,
                          kind="vllm", description=desc)
    if validate:
        params = getattr(inventory, "params", None)
        if params is not None:
            _validate_unique(layout, params)
    return layout


def _validate_unique(layout: EngineLayout, params: dict) -> None:
    """``EngineLayout.validate`` over each distinct EngineTensor object once (ranks and replicas
    share them), packed into as few synthetic ranks as names allow. Same checks, same errors
    (the rank named is the first rank holding that tensor)."""
    first_rank: dict[int, int] = {}
    tensors: dict[int, EngineTensor] = {}
    seen_dicts: set[int] = set()
    for rank, ts in layout.tensors.items():
        if not 0 <= rank < layout.world_size:
            raise LayoutError(f"engine rank {rank} outside world size {layout.world_size}")
        if id(ts) in seen_dicts:
            continue
        seen_dicts.add(id(ts))
        for t in ts.values():
            if id(t) not in tensors:
                tensors[id(t)] = t
                first_rank[id(t)] = rank
    by_rank: dict[int, dict[str, EngineTensor]] = {}
    for key, t in tensors.items():
        by_rank.setdefault(first_rank[key], {})
        slot = by_rank[first_rank[key]]
        if t.name in slot:  # two distinct tensors of one name first seen on one rank: cannot happen
            raise LayoutError(f"engine rank {first_rank[key]} holds two tensors named {t.name!r}")
        slot[t.name] = t
    EngineLayout(layout.world_size, by_rank, kind=layout.kind).validate(params)
