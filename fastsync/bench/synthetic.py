"""Small synthetic models and layouts built straight from the contract types.

For property tests and quick experiments of the planner: a Qwen3/Mixtral-shaped inventory
(embedding, q/k/v/o, dense or MoE MLP with fused or per-expert HF tensors, norms, lm_head),
trainer layouts (FSDP2 ``Shard(dim)``, HSDP, DeepSpeed ZeRO-3 flat partitions, Megatron-like
TP x DP x PP) and vLLM-like engine layouts (TP with fused ``qkv_proj``/``gate_up_proj``,
row-parallel ``o_proj``/``down_proj``, expert-parallel or TP-sharded 3-D ``w13``/``w2``,
replicas, optional FP8 block weights with their scale tensors). The real builders live in
``fastsync.layout``; these are deliberately independent of them.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastsync.layout.box import Box, box_numel, box_shape, chunk_bounds, full_box
from fastsync.layout.trainer import zero3_layout  # the one ZeRO-3 partitioning, re-exported for tests
from fastsync.layout.types import FP8_BLOCK, EngineLayout, EngineTensor, ParamSpec, Piece, Shard, TrainerLayout

__all__ = [
    "ModelDims",
    "small_model",
    "fsdp_layout",
    "zero3_layout",
    "megatron_layout",
    "engine_layout",
]

BLOCK = FP8_BLOCK


@dataclass(frozen=True, slots=True)
class ModelDims:
    layers: int = 1
    hidden: int = 64
    q_dim: int = 64
    kv_dim: int = 32
    inter: int = 96
    experts: int = 0
    moe_inter: int = 32
    vocab: int = 128
    fused_experts: bool = True
    dtype: str = "bfloat16"


def small_model(d: ModelDims) -> dict[str, ParamSpec]:
    """HF transformers-v5 style names and shapes (fused experts ``gate_up_proj`` (E, 2I, H),
    ``down_proj`` (E, H, I), or per-expert ``experts.{e}.{gate,up,down}_proj.weight``)."""
    out: dict[str, ParamSpec] = {}

    def add(name: str, *shape: int) -> None:
        out[name] = ParamSpec(name, tuple(shape), d.dtype)

    H = d.hidden
    add("model.embed_tokens.weight", d.vocab, H)
    for i in range(d.layers):
        p = f"model.layers.{i}."
        add(p + "input_layernorm.weight", H)
        add(p + "self_attn.q_proj.weight", d.q_dim, H)
        add(p + "self_attn.k_proj.weight", d.kv_dim, H)
        add(p + "self_attn.v_proj.weight", d.kv_dim, H)
        add(p + "self_attn.o_proj.weight", H, d.q_dim)
        add(p + "post_attention_layernorm.weight", H)
        if d.experts:
            add(p + "mlp.gate.weight", d.experts, H)
            if d.fused_experts:
                add(p + "mlp.experts.gate_up_proj", d.experts, 2 * d.moe_inter, H)
                add(p + "mlp.experts.down_proj", d.experts, H, d.moe_inter)
            else:
                for e in range(d.experts):
                    add(p + f"mlp.experts.{e}.gate_proj.weight", d.moe_inter, H)
                    add(p + f"mlp.experts.{e}.up_proj.weight", d.moe_inter, H)
                    add(p + f"mlp.experts.{e}.down_proj.weight", H, d.moe_inter)
        else:
            add(p + "mlp.gate_proj.weight", d.inter, H)
            add(p + "mlp.up_proj.weight", d.inter, H)
            add(p + "mlp.down_proj.weight", H, d.inter)
    add("model.norm.weight", H)
    add("lm_head.weight", d.vocab, H)
    return out


# ---- trainer side ---------------------------------------------------------------------------


def fsdp_layout(params: dict[str, ParamSpec], num_shards: int, *, dim: int = 0, replicas: int = 1) -> TrainerLayout:
    """FSDP2 ``Shard(dim)`` (``torch.chunk`` bounds, trailing ranks possibly empty); with
    ``replicas > 1`` HSDP: replica group ``r`` is ranks ``r*num_shards ...``."""
    shards: dict[str, tuple[Shard, ...]] = {}
    for name, spec in params.items():
        d = dim if dim < len(spec.shape) else 0
        out = []
        for r in range(replicas):
            for i, (s, e) in enumerate(chunk_bounds(spec.shape[d], num_shards)):
                box = tuple((s, e) if k == d else (0, n) for k, n in enumerate(spec.shape))
                out.append(Shard(r * num_shards + i, box))
        shards[name] = tuple(out)
    kind = "hsdp" if replicas > 1 else "fsdp"
    return TrainerLayout(num_shards * replicas, dict(params), shards, kind, f"{kind} Shard({dim}) x{num_shards}")


def _megatron_dim(name: str, ndim: int) -> int | None:
    """Column-parallel (dim 0), row-parallel (last dim), replicated (None)."""
    if ndim == 1 or name.endswith("mlp.gate.weight"):
        return None
    if "o_proj" in name or "down_proj" in name:
        return ndim - 1
    if ndim == 3:
        return 1  # fused experts: TP inside each expert
    return 0


def megatron_layout(params: dict[str, ParamSpec], tp: int, dp: int, pp: int) -> TrainerLayout:
    """Megatron-like: rank = stage*(dp*tp) + d*tp + t. Layer ``i`` on stage ``i*pp // layers``,
    embedding on the first stage, final norm and lm_head on the last; TP column/row split
    (``chunk`` bounds), DP replicas."""
    layer_ids = sorted({int(n.split(".")[2]) for n in params if n.startswith("model.layers.")})
    num_layers = max(len(layer_ids), 1)
    shards: dict[str, tuple[Shard, ...]] = {}
    for name, spec in params.items():
        if name.startswith("model.layers."):
            stage = int(name.split(".")[2]) * pp // num_layers
        elif name.startswith("model.embed"):
            stage = 0
        else:
            stage = pp - 1
        d = _megatron_dim(name, len(spec.shape))
        out = []
        for rep in range(dp):
            for t in range(tp):
                rank = stage * dp * tp + rep * tp + t
                if d is None:
                    box = full_box(spec.shape)
                else:
                    s, e = chunk_bounds(spec.shape[d], tp)[t]
                    box = tuple((s, e) if k == d else (0, n) for k, n in enumerate(spec.shape))
                out.append(Shard(rank, box))
        shards[name] = tuple(out)
    return TrainerLayout(tp * dp * pp, dict(params), shards, "megatron", f"megatron tp{tp} dp{dp} pp{pp}")


# ---- engine side ----------------------------------------------------------------------------

Segment = tuple[tuple[int, int] | None, str, Box]  # (expert range in dst or None, param, src box)


def _seg_dims(seg: Segment) -> tuple[int, int, int]:
    """(experts, rows, cols) of a segment's source box."""
    shp = box_shape(seg[2])
    if len(shp) == 3:
        return shp[0], shp[1], shp[2]
    if len(shp) == 2:
        return 1, shp[0], shp[1]
    return 1, 1, shp[0]


def _stack(name: str, segs: list[Segment], dtype: str, fp8: bool) -> dict[str, EngineTensor]:
    """An engine tensor made of segments stacked along its row dim (per expert range when the
    tensor is 3-D); with ``fp8`` the weight is block-quantised and a ``<name>_scale`` float32
    tensor of the matching blocks is added."""
    three_d = segs[0][0] is not None
    row_off: dict[object, int] = {}
    srow_off: dict[object, int] = {}
    pieces, spieces = [], []
    cols = scols = 0
    lead_total = 0
    for seg in segs:
        lead, param, src = seg
        e, r, c = _seg_dims(seg)
        key = lead
        o, so = row_off.get(key, 0), srow_off.get(key, 0)
        sr, sc = -(-r // BLOCK), -(-c // BLOCK)
        if three_d:
            assert lead is not None
            dst = (lead, (o, o + r), (0, c))
            sdst = (lead, (so, so + sr), (0, sc))
            lead_total = max(lead_total, lead[1])
        else:
            dst = ((o, o + r), (0, c)) if len(box_shape(src)) > 1 else ((o, o + c),)
            sdst = ((so, so + sr), (0, sc))
        row_off[key], srow_off[key] = o + r, so + sr
        cols, scols = c, sc
        if fp8:
            pieces.append(Piece(dst, param, src, "fp8_block"))
            spieces.append(Piece(sdst, param, src, "fp8_scale"))
        else:
            pieces.append(Piece(dst, param, src))
    rows, srows = max(row_off.values()), max(srow_off.values())
    if three_d:
        shape, sshape = (lead_total, rows, cols), (lead_total, srows, scols)
    elif len(pieces[0].dst_box) == 1:
        shape, sshape = (cols,), ()
    else:
        shape, sshape = (rows, cols), (srows, scols)
    out = {name: EngineTensor(name, shape, "float8_e4m3fn" if fp8 else dtype, tuple(pieces))}
    if fp8:
        out[name + "_scale"] = EngineTensor(name + "_scale", sshape, "float32", tuple(spieces))
    return out


def _rows(spec: ParamSpec, s: int, e: int, dim: int = 0) -> Box:
    return tuple((s, e) if k == dim else (0, n) for k, n in enumerate(spec.shape))


def engine_layout(
    params: dict[str, ParamSpec],
    d: ModelDims,
    *,
    tp: int,
    replicas: int = 1,
    fp8: bool = False,
    expert_parallel: bool = True,
    dtype: str = "bfloat16",
) -> EngineLayout:
    """vLLM-like: per replica ``tp`` ranks (rank = replica*tp + t); q/k/v, gate/up fused and
    column-parallel, o/down row-parallel, embedding/lm_head vocab-parallel, norms and router
    replicated; experts split across the ``tp`` ranks (expert parallel) or TP-sharded inside
    each expert. Split sizes must divide evenly (as vLLM requires)."""
    tensors: dict[int, dict[str, EngineTensor]] = {}
    P = params

    def part(n: int, t: int) -> tuple[int, int]:
        assert n % tp == 0, (n, tp)
        return t * n // tp, (t + 1) * n // tp

    for rep in range(replicas):
        for t in range(tp):
            ts: dict[str, EngineTensor] = {}
            for nm in ("model.embed_tokens.weight", "lm_head.weight"):
                s, e = part(P[nm].shape[0], t)
                ts.update(_stack(nm, [(None, nm, _rows(P[nm], s, e))], dtype, False))
            for nm, spec in P.items():
                if len(spec.shape) == 1 or nm.endswith("mlp.gate.weight"):
                    ts.update(_stack(nm, [(None, nm, full_box(spec.shape))], dtype, False))
            for i in range(d.layers):
                p = f"model.layers.{i}."
                a = p + "self_attn."
                segs = []
                for x in "qkv":
                    nm = a + f"{x}_proj.weight"
                    s, e = part(P[nm].shape[0], t)
                    segs.append((None, nm, _rows(P[nm], s, e)))
                ts.update(_stack(a + "qkv_proj.weight", segs, dtype, fp8))
                nm = a + "o_proj.weight"
                s, e = part(P[nm].shape[1], t)
                ts.update(_stack(nm, [(None, nm, _rows(P[nm], s, e, 1))], dtype, fp8))
                if not d.experts:
                    m = p + "mlp."
                    segs = []
                    for x in ("gate", "up"):
                        nm = m + f"{x}_proj.weight"
                        s, e = part(P[nm].shape[0], t)
                        segs.append((None, nm, _rows(P[nm], s, e)))
                    ts.update(_stack(m + "gate_up_proj.weight", segs, dtype, fp8))
                    nm = m + "down_proj.weight"
                    s, e = part(P[nm].shape[1], t)
                    ts.update(_stack(nm, [(None, nm, _rows(P[nm], s, e, 1))], dtype, fp8))
                    continue
                ts.update(_experts(P, d, p + "mlp.experts.", t, tp, expert_parallel, dtype, fp8))
            tensors[rep * tp + t] = ts
    replica_of = {rep * tp + t: rep for rep in range(replicas) for t in range(tp)}
    kind = "vllm"
    return EngineLayout(tp * replicas, tensors, replica_of, kind,
                        f"tp{tp} x{replicas} {'ep' if expert_parallel else 'tp-moe'}{' fp8' if fp8 else ''}")


def _experts(P: dict[str, ParamSpec], d: ModelDims, ex: str, t: int, tp: int, ep: bool, dtype: str,
             fp8: bool) -> dict[str, EngineTensor]:
    E, MI, H = d.experts, d.moe_inter, d.hidden
    if ep:
        assert E % tp == 0, (E, tp)
        e0, e1 = t * E // tp, (t + 1) * E // tp
        r0, r1 = 0, MI
    else:
        e0, e1 = 0, E
        assert MI % tp == 0, (MI, tp)
        r0, r1 = t * MI // tp, (t + 1) * MI // tp
    w13: list[Segment] = []
    w2: list[Segment] = []
    if d.fused_experts:
        gu, dn = ex + "gate_up_proj", ex + "down_proj"
        lead = (0, e1 - e0)
        w13.append((lead, gu, ((e0, e1), (r0, r1), (0, H))))
        w13.append((lead, gu, ((e0, e1), (MI + r0, MI + r1), (0, H))))
        w2.append((lead, dn, ((e0, e1), (0, H), (r0, r1))))
    else:
        for k, e in enumerate(range(e0, e1)):
            w13.append(((k, k + 1), ex + f"{e}.gate_proj.weight", ((r0, r1), (0, H))))
            w13.append(((k, k + 1), ex + f"{e}.up_proj.weight", ((r0, r1), (0, H))))
            w2.append(((k, k + 1), ex + f"{e}.down_proj.weight", ((0, H), (r0, r1))))
    out = _stack(ex + "w13_weight", w13, dtype, fp8)
    out.update(_stack(ex + "w2_weight", w2, dtype, fp8))
    return out
