"""A ``NameMap`` from a recording of vLLM's own weight loaders (``record.py``).

A recording says, for ONE worker, which box of which checkpoint tensor its loaders copy into
which box of each (rank-local) engine parameter. A name map speaks in full, unsharded engine
coordinates plus a parallel style, so ``layout/engine.py`` can derive any rank's tensors. This
module bridges the two, in order:

1. The style of each engine parameter from vLLM's layer class (``_spec``): ``QKVParallelLinear``
   -> column by heads (q | k | v, KV heads replicated where fewer than ranks),
   ``MergedColumnParallelLinear`` -> column with one part per output (gate | up),
   ``ColumnParallelLinear`` -> column, ``RowParallelLinear`` -> row on the input dim (its bias
   replicated), ``VocabParallelEmbedding`` / ``ParallelLMHead`` -> vocab (padded rows never
   written), fused-MoE ``w13_weight`` / ``w2_weight`` -> column (gate | up) / row with the expert
   dim, layers with ``disable_tp`` and everything else -> replicated.
2. Each recorded copy is mapped from local to global coordinates through that style's rank
   intervals, then extended along the sharded dim to what the same loader copies at TP 1.
3. Copies that are translations of each other are merged (the per-expert, per-half copies of a
   fused ``experts.gate_up_proj`` become one segment), giving the same segments a hand-written
   map has.
4. Self-check: the rank's tensors derived back from the map (``engine_tensors_for_rank``) must
   hold exactly the recorded copies, or the parameter is named (a style fastsync misread).

Refused checkpoint tensors (an operation that is not a copy of a box) fall back
(``fallback.py``): :attr:`RecordedMap.fallback` names each with the operation,
:attr:`RecordedMap.loads` the engine parameters vLLM's own loader fills from them; those
parameters are left out of the map. An engine parameter nothing fills is refused
(:attr:`RecordedMap.refused`). Expert parallelism: a rank sees only its experts, at local rows;
step 2 maps them to global experts through the layer's own ``ep_size``/``ep_rank`` and extends a
fused checkpoint tensor's copy of one expert to all of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastsync.errors import LayoutError
from fastsync.layout.box import Box, box_shape
from fastsync.layout.engine import engine_tensors_for_rank, rank_intervals
from fastsync.layout.namemap import EngineParam, NameMap, Part, Segment
from fastsync.engines.vllm.names import ENGINE_ONLY
from fastsync.engines.vllm.record import Copy, Recording

__all__ = ["RecordedMap", "name_map_from_recording", "merge_segments"]

ENGINE = "vllm"


@dataclass(slots=True)
class RecordedMap:
    """The map plus what could not be recorded. ``fallback``: checkpoint tensor -> why it goes
    through vLLM's ``load_weights`` (the operation); ``loads``: engine parameter -> the fallback
    tensors that fill it (not in the map); ``refused``: what fastsync cannot sync at all (an
    engine parameter nothing fills), name -> why. ``names`` / ``splits``: how the loader is fed."""

    name_map: NameMap
    params: dict[str, tuple[int, ...]]
    fallback: dict[str, str] = field(default_factory=dict)
    loads: dict[str, tuple[str, ...]] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)
    names: dict[str, str] = field(default_factory=dict)
    splits: dict = field(default_factory=dict)


def _spec(module: Any, attr: str, local: tuple[int, ...], param: Any) -> tuple[str, int, tuple[Part, ...], int | None,
                                                                          tuple[int, ...]]:
    """(style, shard_dim, parts, expert_dim, full shape) of one engine parameter."""
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        LinearBase,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        ReplicatedLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    full = list(local)
    if isinstance(module, VocabParallelEmbedding):
        full[0] = int(module.org_vocab_size)
        return "vocab", 0, (), None, tuple(full)
    if isinstance(module, LinearBase):
        tp = int(getattr(module, "tp_size", 1))
        if isinstance(module, ReplicatedLinear) or getattr(module, "disable_tp", False):
            return "replicated", 0, (), None, tuple(local)
        out_dim = int(getattr(param, "output_dim", 0) or 0)
        if isinstance(module, QKVParallelLinear):
            hs, vhs = int(module.head_size), int(module.v_head_size)
            h, kv = int(module.total_num_heads), int(module.total_num_kv_heads)
            parts = (Part(h * hs, h), Part(kv * hs, kv), Part(kv * vhs, kv))
        elif isinstance(module, MergedColumnParallelLinear):
            parts = tuple(Part(int(s)) for s in module.output_sizes)
        elif isinstance(module, ColumnParallelLinear):
            parts = (Part(int(module.output_size)),)
        elif isinstance(module, RowParallelLinear):
            if attr != "weight":
                return "replicated", 0, (), None, tuple(local)
            in_dim = int(getattr(param, "input_dim", 1))
            full[in_dim] = local[in_dim] * tp
            return "row", in_dim, (), None, tuple(full)
        else:
            return "replicated", 0, (), None, tuple(local)
        full[out_dim] = sum(p.size for p in parts)
        return "column", out_dim, parts, None, tuple(full)
    cfg = getattr(module, "moe_config", None)
    if cfg is not None and attr in ("w13_weight", "w2_weight") and len(local) == 3:
        moe_tp = int(getattr(cfg, "tp_size", 1))
        full[0] = int(getattr(module, "global_num_experts", local[0]))
        if attr == "w13_weight":
            inter = local[1] // 2 * moe_tp
            full[1] = 2 * inter
            return "column", 1, (Part(inter), Part(inter)), 0, tuple(full)
        full[2] = local[2] * moe_tp
        return "row", 2, (), 0, tuple(full)
    return "replicated", 0, (), None, tuple(local)


def _align(dst: Box, src: Box) -> dict[int, int]:
    """dst dim -> src dim for the dims with extent > 1 (the boxes agree once size-1 dims go)."""
    d = [k for k, (a, b) in enumerate(dst) if b - a > 1]
    s = [k for k, (a, b) in enumerate(src) if b - a > 1]
    return dict(zip(d, s))


def _to_global(ep: EngineParam, iv: list[list[tuple[int, int]]], c: Copy,
               src_shape: tuple[int, ...]) -> Segment:
    """The TP-1 segment of which ``c`` is this rank's slice."""
    dst, src = list(c.dst_box), list(c.src_box)
    align = _align(c.dst_box, c.src_box)
    for j, ivs in enumerate(iv):
        if ivs == [(0, ep.shape[j])]:
            continue
        l0, l1 = dst[j]
        off = 0
        for a, b in ivs:
            if off <= l0 and l1 <= off + (b - a):
                g0, part = a + l0 - off, a
                break
            off += b - a
        else:
            raise LayoutError(f"engine parameter {ep.name!r}: recorded copy of {c.src!r} rows {l0}:{l1} spans two "
                              f"of this rank's slices {ivs}")
        dst[j] = (g0, g0 + l1 - l0)
        # the part (column) or the whole dim (row, vocab, expert) the slice belongs to
        lo, hi = 0, ep.shape[j]
        if ep.style == "column" and j == ep.shard_dim:
            for p in ep.parts:
                if lo <= g0 < lo + p.size:
                    hi = lo + p.size
                    break
                lo += p.size
        if j not in align:
            if j == ep.expert_dim and l1 - l0 == 1:
                # expert parallelism: this rank's loaders copied only its experts; a fused checkpoint
                # tensor holds every expert at the same index, so the copy of expert g is the TP-1
                # copy of all of them (self-checked against the rank's recorded copies)
                same = [k for k, (a, b) in enumerate(src) if (a, b) == (g0, g0 + 1) and src_shape[k] == ep.shape[j]
                        and k not in align.values()]
                if same:
                    src[same[0]], dst[j] = (0, ep.shape[j]), (0, ep.shape[j])
                continue
            if l1 - l0 == ep.shape[j]:
                continue
            raise LayoutError(f"engine parameter {ep.name!r}: cannot tell which dim of {c.src!r} its sharded dim "
                              f"{j} comes from (copy {c.dst_box} <- {c.src_box})")
        s = align[j]
        shift = g0 - src[s][0]
        s0, s1 = max(0, lo - shift), min(src_shape[s], hi - shift)
        src[s], dst[j] = (s0, s1), (s0 + shift, s1 + shift)
        del part
    return Segment(c.src, tuple(src), tuple(dst))


def merge_segments(segs: list[Segment]) -> list[Segment]:
    """Merge segments of one source that are translations of each other and adjacent along one
    dim (same element pairing, fewer segments); others are kept as they are. Order: by dst."""
    groups: dict[tuple, list[Segment]] = {}
    rest: list[Segment] = []
    for s in set(segs):
        if len(s.src_box) != len(s.dst_box) or box_shape(s.src_box) != box_shape(s.dst_box):
            rest.append(s)
            continue
        shift = tuple(d0 - s0 for (d0, _), (s0, _) in zip(s.dst_box, s.src_box))
        groups.setdefault((s.src, shift), []).append(s)
    out = list(rest)
    for (src, shift), members in groups.items():
        boxes = [m.dst_box for m in members]
        for k in reversed(range(len(shift))):
            boxes.sort(key=lambda b: tuple(x for j, x in enumerate(b) if j != k) + (b[k],))
            merged: list[Box] = []
            for b in boxes:
                if merged:
                    m = merged[-1]
                    if m[k][1] == b[k][0] and all(m[j] == b[j] for j in range(len(b)) if j != k):
                        merged[-1] = m[:k] + ((m[k][0], b[k][1]),) + m[k + 1:]
                        continue
                merged.append(b)
            boxes = merged
        for b in boxes:
            out.append(Segment(src, tuple((d0 - sh, d1 - sh) for (d0, d1), sh in zip(b, shift)), b))
    return sorted(out, key=lambda s: (s.dst_box, s.src))


def name_map_from_recording(model: Any, rec: Recording, *, architecture: str, tp_size: int = 1, tp_rank: int = 0,
                            ep_size: int = 1, model_dtype: str | None = None,
                            aliases: dict[str, str] | None = None, fallback: dict[str, str] | None = None,
                            loads: dict[str, tuple[str, ...]] | None = None) -> RecordedMap:
    """The name map of ``rec`` (one worker's recording at TP ``tp_size``, rank ``tp_rank``).
    ``aliases``: engine parameters that are views of another one's memory (``live_aliases``): no
    loader writes them and none is mapped; they follow the parameter they view. ``fallback`` /
    ``loads``: what goes through vLLM's own loader (``fallback.plan_fallback``); without them
    every refused checkpoint tensor is refused outright. Expert parallelism (``ep_size`` > 1) is
    read from each fused-MoE layer's own config: a rank's loaders copy only its experts, at local
    rows; vLLM's linear placement maps them back to global experts (checked by the self-check)."""
    loads = loads or {}
    moe_ep = (1, 0)
    fallback = dict(fallback if fallback is not None else {})
    refused = {n: why for n, why in rec.refused.items() if n not in fallback}
    params: list[EngineParam] = []
    engine_only: dict[str, str] = {}
    for name, local in rec.shapes.items():
        if name in (aliases or {}) or name in loads:
            continue
        copies = rec.copies.get(name, [])
        if not copies:
            known = next((why for suffix, why in ENGINE_ONLY.items() if name.endswith(suffix)), None)
            if known is not None:
                engine_only[name] = known
            else:  # a trainer update would never reach it: refuse rather than serve a stale tensor
                refused[name] = (f"engine parameter {name!r}: no checkpoint tensor is loaded into it by vLLM's "
                                  f"load_weights (checkpoint tensors it ignored: {sorted(rec.skipped)[:4]})")
            continue
        path, _, attr = name.rpartition(".")
        module = model.get_submodule(path) if path else model
        style, shard_dim, parts, expert_dim, full = _spec(module, attr, local, getattr(module, attr, None))
        dtype = rec.dtypes.get(name)
        probe = EngineParam(name, full, style, (), shard_dim=shard_dim, parts=parts, expert_dim=expert_dim)
        if expert_dim is None:
            iv = rank_intervals(probe, tp=tp_size, tp_rank=tp_rank)
        else:
            cfg = module.moe_config
            moe_ep = (int(getattr(cfg, "ep_size", 1)), int(getattr(cfg, "ep_rank", 0)))
            if moe_ep[0] != ep_size:
                raise LayoutError(f"engine parameter {name!r}: its MoE layer has expert-parallel size {moe_ep[0]}, "
                                  f"the engine {ep_size}")
            iv = rank_intervals(probe, tp=int(getattr(cfg, "tp_size", 1)), tp_rank=int(getattr(cfg, "tp_rank", 0)),
                                ep_size=moe_ep[0], ep_rank=moe_ep[1])
        if iv is None:
            raise LayoutError(f"engine parameter {name!r}: this rank holds none of it, yet loaders wrote into it")
        segs = merge_segments([_to_global(probe, iv, c, rec.params[c.src]) for c in copies])
        params.append(EngineParam(name, full, style, tuple(segs), shard_dim=shard_dim, parts=parts,
                                  expert_dim=expert_dim, dtype=None if dtype == model_dtype else dtype))
    unused = {n: "vLLM's load_weights consumes it without writing an engine parameter (e.g. tied to the embedding)"
              for n in sorted(rec.skipped)}
    nm = NameMap(architecture, ENGINE, params, unused, engine_only=engine_only)
    out = RecordedMap(nm, dict(rec.params), fallback, dict(loads), refused)
    if not refused:
        _self_check(nm, rec, tp_size, tp_rank, *moe_ep)
    return out


def _self_check(nm: NameMap, rec: Recording, tp: int, tp_rank: int, ep_size: int = 1, ep_rank: int = 0) -> None:
    """The rank's tensors derived from the map hold exactly the recorded copies."""
    got = engine_tensors_for_rank(None, nm, tp_size=tp, tp_rank=tp_rank, ep_size=ep_size, ep_rank=ep_rank,
                                  dtype="float32")
    for ep in nm.params:
        t = got.get(ep.name)
        want = merge_segments([Segment(c.src, c.src_box, c.dst_box) for c in rec.copies[ep.name]])
        have = merge_segments([Segment(p.src, p.src_box, p.dst_box) for p in (t.pieces if t else ())])
        if want != have:
            raise LayoutError(f"engine parameter {ep.name!r}: the {ep.style} split fastsync reads from vLLM's layer "
                              f"does not reproduce what its loaders copy on TP rank {tp_rank} of {tp} "
                              f"(recorded {want[:2]}..., derived {have[:2]}...)")



def record_engine_layout(model: Any, hf_config: Any, *, model_dir: str | None, architecture: str, tp_size: int,
                         tp_rank: int, ep_size: int = 1, model_dtype: str | None = None,
                         params: dict[str, tuple[tuple[int, ...], str]] | None = None) -> RecordedMap:
    """Record this worker's layout: list the checkpoint's tensors (``params``, else the trainer's
    transformers names from the config, else the safetensors headers), run vLLM's loaders on
    recording tensors, derive the name map."""
    from fastsync.engines.vllm.layout import live_aliases
    from fastsync.engines.vllm.record import record_copies
    from fastsync.engines.vllm.record_names import checkpoint_params, expert_splits, loader_names

    from fastsync.engines.vllm.fallback import plan_fallback, probe_writes

    params = params if params is not None else checkpoint_params(hf_config, model_dir)
    aliases = live_aliases(model)  # before the recording swaps meta twins in
    names = loader_names(hf_config, list(params))
    splits = expert_splits(hf_config, params, names)
    rec = record_copies(model, params, names=names, splits=splits)
    fed = splits if rec.split_fed else {}
    why, loads = plan_fallback(rec, params, lambda t: probe_writes(model, t, names, fed)) if rec.refused else ({}, {})
    out = name_map_from_recording(model, rec, architecture=architecture, tp_size=tp_size, tp_rank=tp_rank,
                                  ep_size=ep_size, model_dtype=model_dtype, aliases=aliases, fallback=why, loads=loads)
    out.names, out.splits = names, fed
    return out


def refusal(recorded: RecordedMap, rank: int) -> LayoutError:
    """The set-up error for what neither the fast path nor the fallback fills, each named."""
    items = sorted(recorded.refused.items())
    listed = "; ".join(why for _, why in items[:5]) + (f"; ... ({len(items)} in all)" if len(items) > 5 else "")
    return LayoutError(f"engine rank {rank}: fastsync cannot keep {len(items)} engine tensor(s) of this model in "
                       f"step with the trainer: {listed}. Use a hand-written name map (fastsync_name_map hook) "
                       "for this architecture")
