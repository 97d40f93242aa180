"""Built-in name maps: HF transformers-v5 parameter names -> vLLM 0.32 engine parameters.

Read off vLLM's own modules (``vllm/model_executor/models/{llama,qwen3,qwen3_moe,mixtral,
deepseek_v2}.py``) and layers:

* ``QKVParallelLinear`` -> ``self_attn.qkv_proj.weight`` = [q | k | v] rows, column parallel by
  heads, KV heads replicated when ``num_kv_heads < tp``.
* ``MergedColumnParallelLinear`` -> ``mlp.gate_up_proj.weight`` = [gate | up], column parallel.
* ``RowParallelLinear`` -> ``o_proj`` / ``down_proj``, input dim split.
* ``VocabParallelEmbedding`` / ``ParallelLMHead`` -> vocab split (padded to 64); a tied
  ``lm_head`` is the embedding itself (no engine tensor of its own).
* ``FusedMoEFactory`` -> a runner module whose ``routed_experts`` child holds ``w13_weight``
  [E, 2I, H] (per expert [gate; up], exactly the v5 ``gate_up_proj``) and ``w2_weight``
  [E, H, I] (the v5 ``down_proj``); the router ``GateLinear`` stays at ``mlp.gate.weight``
  (Mixtral: ``block_sparse_moe.gate.weight``), replicated.
* DeepSeek MLA: ``fused_qkv_a_proj`` = [q_a_proj ; kv_a_proj_with_mqa], replicated
  (``disable_tp``); ``q_b_proj`` / ``kv_b_proj`` column parallel by heads; ``o_proj`` row;
  ``mlp.gate.e_score_correction_bias`` float32, replicated (``topk_method == "noaux_tc"``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from fastsync.errors import ConfigError
from fastsync.layout.box import full_box
from fastsync.layout.namemap import EngineParam, NameMap, Part, Segment
from fastsync.models.archs import cfg_get, expert_format, head_dim_of, is_moe_layer, mla_dims, num_experts_of

__all__ = ["BUILDERS", "vllm_name_map"]

ENGINE = "vllm"


def _whole(name: str, src: str, shape: tuple[int, ...], style: str, **kw: object) -> EngineParam:
    seg = Segment(src, full_box(shape), full_box(shape))
    return EngineParam(name, tuple(shape), style, (seg,), **kw)  # type: ignore[arg-type]


def _stack(name: str, pieces: list[tuple[str, int, int]], inner: tuple[int, ...], *, style: str,
           quantizable: bool) -> EngineParam:
    """Concatenate whole trainer params along dim 0: ``pieces`` = (src, rows, heads)."""
    segs, parts, off = [], [], 0
    for src, rows, heads in pieces:
        shape = (rows, *inner)
        segs.append(Segment(src, full_box(shape), ((off, off + rows), *full_box(inner))))
        parts.append(Part(rows, heads))
        off += rows
    return EngineParam(name, (off, *inner), style, tuple(segs), shard_dim=0, parts=tuple(parts),
                       quantizable=quantizable)


#: Engine parameters vLLM creates that no trainer tensor feeds (left to vLLM, never written).
ENGINE_ONLY = {
    ".attn.k_scale": "FP8 KV-cache scale of a GQA Attention layer (vLLM's default 1.0 unless a checkpoint sets it)",
    ".attn.v_scale": "FP8 KV-cache scale of a GQA Attention layer",
    ".attn.q_scale": "FP8 attention query scale",
    ".attn.prob_scale": "FP8 attention probability scale",
}


def _module(name: str) -> str:
    if ".routed_experts." in name:
        return name.split(".routed_experts.")[0]
    return name.rsplit(".", 1)[0]


def _finish(arch: str, config: dict, out: list[EngineParam], unused: dict[str, str]) -> NameMap:
    """Apply the checkpoint's FP8 ``ignored_layers`` / ``modules_to_not_convert`` the way vLLM's
    ``is_layer_skipped`` does (exact module names; a fused module is skipped when all its parts
    are) and wrap up the map."""
    qc = config.get("quantization_config") or {}
    if not isinstance(qc, dict):
        raise ConfigError(f"{arch}: config.json 'quantization_config' must be an object, got {type(qc).__name__}")
    ignored = qc.get("ignored_layers") or qc.get("modules_to_not_convert") or ()
    if not isinstance(ignored, (list, tuple)) or not all(isinstance(m, str) for m in ignored):
        raise ConfigError(f"{arch}: config.json 'quantization_config' ignored_layers / modules_to_not_convert "
                          f"must be a list of module names, got {ignored!r}"[:300])
    ignored = set(ignored)
    if ignored:
        for i, p in enumerate(out):
            if not p.quantizable:
                continue
            parts = {_module(seg.src) for seg in p.segments}
            if _module(p.name) in ignored or (parts and parts <= ignored):
                out[i] = dataclasses.replace(p, quantizable=False)
    return NameMap(arch, ENGINE, out, unused, engine_only=dict(ENGINE_ONLY))


def _embed_head(config: dict, out: list[EngineParam], unused: dict[str, str]) -> None:
    vocab, hidden = int(cfg_get(config, "vocab_size")), int(cfg_get(config, "hidden_size"))
    out.append(_whole("model.embed_tokens.weight", "model.embed_tokens.weight", (vocab, hidden), "vocab"))
    out.append(_whole("model.norm.weight", "model.norm.weight", (hidden,), "replicated"))
    if config.get("tie_word_embeddings", False):
        unused["lm_head.weight"] = "tied to model.embed_tokens.weight (vLLM shares the embedding)"
    else:
        out.append(_whole("lm_head.weight", "lm_head.weight", (vocab, hidden), "vocab"))


def _gqa(config: dict, p: str, out: list[EngineParam], *, qk_norm: bool) -> None:
    hidden = int(cfg_get(config, "hidden_size"))
    heads = int(cfg_get(config, "num_attention_heads"))
    kv = int(cfg_get(config, "num_key_value_heads", heads))
    hd = head_dim_of(config)
    a = f"{p}.self_attn"
    qkv = [(f"{a}.q_proj.weight", heads * hd, heads), (f"{a}.k_proj.weight", kv * hd, kv),
           (f"{a}.v_proj.weight", kv * hd, kv)]
    out.append(_stack(f"{a}.qkv_proj.weight", qkv, (hidden,), style="column", quantizable=True))
    if config.get("attention_bias", False):
        bias = [(n.replace(".weight", ".bias"), r, h) for n, r, h in qkv]
        out.append(_stack(f"{a}.qkv_proj.bias", bias, (), style="column", quantizable=False))
    out.append(_whole(f"{a}.o_proj.weight", f"{a}.o_proj.weight", (hidden, heads * hd), "row", shard_dim=1,
                      quantizable=True))
    if config.get("attention_bias", False):
        out.append(_whole(f"{a}.o_proj.bias", f"{a}.o_proj.bias", (hidden,), "replicated"))
    if qk_norm:
        out.append(_whole(f"{a}.q_norm.weight", f"{a}.q_norm.weight", (hd,), "replicated"))
        out.append(_whole(f"{a}.k_norm.weight", f"{a}.k_norm.weight", (hd,), "replicated"))


def _mlp(src: str, dst: str, hidden: int, inter: int, out: list[EngineParam]) -> None:
    gu = [(f"{src}.gate_proj.weight", inter, 0), (f"{src}.up_proj.weight", inter, 0)]
    out.append(_stack(f"{dst}.gate_up_proj.weight", gu, (hidden,), style="column", quantizable=True))
    out.append(_whole(f"{dst}.down_proj.weight", f"{src}.down_proj.weight", (hidden, inter), "row", shard_dim=1,
                      quantizable=True))


def _experts(src: str, dst: str, num_experts: int, hidden: int, inter: int, out: list[EngineParam],
             fmt: str = "fused") -> None:
    e = f"{dst}.experts.routed_experts"
    if fmt == "per_expert":
        w13_segs, w2_segs = [], []
        for x in range(num_experts):
            ex = ((x, x + 1),)
            w13_segs.append(Segment(f"{src}.experts.{x}.gate_proj.weight", full_box((inter, hidden)),
                                    ex + ((0, inter), (0, hidden))))
            w13_segs.append(Segment(f"{src}.experts.{x}.up_proj.weight", full_box((inter, hidden)),
                                    ex + ((inter, 2 * inter), (0, hidden))))
            w2_segs.append(Segment(f"{src}.experts.{x}.down_proj.weight", full_box((hidden, inter)),
                                   ex + ((0, hidden), (0, inter))))
        out.append(EngineParam(f"{e}.w13_weight", (num_experts, 2 * inter, hidden), "column", tuple(w13_segs),
                               shard_dim=1, parts=(Part(inter), Part(inter)), expert_dim=0, quantizable=True))
        out.append(EngineParam(f"{e}.w2_weight", (num_experts, hidden, inter), "row", tuple(w2_segs),
                               shard_dim=2, expert_dim=0, quantizable=True))
        return
    w13 = _whole(f"{e}.w13_weight", f"{src}.experts.gate_up_proj", (num_experts, 2 * inter, hidden), "column",
                 shard_dim=1, parts=(Part(inter), Part(inter)), expert_dim=0, quantizable=True)
    w2 = _whole(f"{e}.w2_weight", f"{src}.experts.down_proj", (num_experts, hidden, inter), "row",
                shard_dim=2, expert_dim=0, quantizable=True)
    out.extend((w13, w2))


def _norms(p: str, hidden: int, out: list[EngineParam]) -> None:
    for n in ("input_layernorm", "post_attention_layernorm"):
        out.append(_whole(f"{p}.{n}.weight", f"{p}.{n}.weight", (hidden,), "replicated"))


def _dense(config: dict, *, qk_norm: bool, arch: str) -> NameMap:
    hidden, inter = int(cfg_get(config, "hidden_size")), int(cfg_get(config, "intermediate_size"))
    out: list[EngineParam] = []
    unused: dict[str, str] = {}
    for i in range(int(cfg_get(config, "num_hidden_layers"))):
        p = f"model.layers.{i}"
        _gqa(config, p, out, qk_norm=qk_norm)
        _mlp(f"{p}.mlp", f"{p}.mlp", hidden, inter, out)
        _norms(p, hidden, out)
    _embed_head(config, out, unused)
    return _finish(arch, config, out, unused)


def llama_map(config: dict) -> NameMap:
    return _dense(config, qk_norm=False, arch="LlamaForCausalLM")


def qwen3_map(config: dict) -> NameMap:
    return _dense(config, qk_norm=True, arch="Qwen3ForCausalLM")


def qwen3_moe_map(config: dict) -> NameMap:
    arch = "Qwen3MoeForCausalLM"
    hidden = int(cfg_get(config, "hidden_size"))
    num_experts, moe_inter = num_experts_of(config), int(cfg_get(config, "moe_intermediate_size"))
    out: list[EngineParam] = []
    unused: dict[str, str] = {}
    for i in range(int(cfg_get(config, "num_hidden_layers"))):
        p = f"model.layers.{i}"
        _gqa(config, p, out, qk_norm=True)
        if is_moe_layer(arch, config, i):
            # Qwen3-MoE hands its quant_config to the router GateLinear: FP8 checkpoints quantise it
            out.append(_whole(f"{p}.mlp.gate.weight", f"{p}.mlp.gate.weight", (num_experts, hidden), "replicated",
                              quantizable=True))
            _experts(f"{p}.mlp", f"{p}.mlp", num_experts, hidden, moe_inter, out, expert_format(config))
        else:
            _mlp(f"{p}.mlp", f"{p}.mlp", hidden, int(cfg_get(config, "intermediate_size")), out)
        _norms(p, hidden, out)
    _embed_head(config, out, unused)
    return _finish(arch, config, out, unused)


def mixtral_map(config: dict) -> NameMap:
    hidden, inter = int(cfg_get(config, "hidden_size")), int(cfg_get(config, "intermediate_size"))
    num_experts = num_experts_of(config)
    out: list[EngineParam] = []
    unused: dict[str, str] = {}
    for i in range(int(cfg_get(config, "num_hidden_layers"))):
        p = f"model.layers.{i}"
        _gqa(config, p, out, qk_norm=False)
        m = f"{p}.block_sparse_moe"
        out.append(_whole(f"{m}.gate.weight", f"{p}.mlp.gate.weight", (num_experts, hidden), "replicated"))
        _experts(f"{p}.mlp", m, num_experts, hidden, inter, out, expert_format(config))
        _norms(p, hidden, out)
    _embed_head(config, out, unused)
    return _finish("MixtralForCausalLM", config, out, unused)


def deepseek_v3_map(config: dict) -> NameMap:
    arch = "DeepseekV3ForCausalLM"
    hidden, inter = int(cfg_get(config, "hidden_size")), int(cfg_get(config, "intermediate_size"))
    d = mla_dims(config)
    heads, q_lora, kv_lora, rope = d["heads"], d["q_lora_rank"], d["kv_lora_rank"], d["qk_rope_head_dim"]
    assert heads is not None and kv_lora is not None and rope is not None
    qk_head = int(d["qk_nope_head_dim"] or 0) + rope
    v_head = int(d["v_head_dim"] or 0)
    num_experts, moe_inter = num_experts_of(config), int(cfg_get(config, "moe_intermediate_size"))
    num_shared = int(cfg_get(config, "n_shared_experts", 0))
    noaux = config.get("topk_method") == "noaux_tc"
    if int(cfg_get(config, "moe_layer_freq", 1)) != 1:
        raise ConfigError("DeepseekV3ForCausalLM with moe_layer_freq != 1 is not supported (transformers v5 ignores it)")
    out: list[EngineParam] = []
    unused: dict[str, str] = {}
    for i in range(int(cfg_get(config, "num_hidden_layers"))):
        a = f"model.layers.{i}.self_attn"
        if q_lora is None:
            out.append(_stack(f"{a}.q_proj.weight", [(f"{a}.q_proj.weight", heads * qk_head, heads)], (hidden,),
                              style="column", quantizable=True))
            out.append(_whole(f"{a}.kv_a_proj_with_mqa.weight", f"{a}.kv_a_proj_with_mqa.weight",
                              (kv_lora + rope, hidden), "replicated", quantizable=True))
        else:
            fused = [(f"{a}.q_a_proj.weight", q_lora, 0), (f"{a}.kv_a_proj_with_mqa.weight", kv_lora + rope, 0)]
            out.append(_stack(f"{a}.fused_qkv_a_proj.weight", fused, (hidden,), style="replicated", quantizable=True))
            out.append(_whole(f"{a}.q_a_layernorm.weight", f"{a}.q_a_layernorm.weight", (q_lora,), "replicated"))
            out.append(_stack(f"{a}.q_b_proj.weight", [(f"{a}.q_b_proj.weight", heads * qk_head, heads)], (q_lora,),
                              style="column", quantizable=True))
        out.append(_whole(f"{a}.kv_a_layernorm.weight", f"{a}.kv_a_layernorm.weight", (kv_lora,), "replicated"))
        kvb = [(f"{a}.kv_b_proj.weight", heads * (qk_head - rope + v_head), heads)]
        out.append(_stack(f"{a}.kv_b_proj.weight", kvb, (kv_lora,), style="column", quantizable=True))
        out.append(_whole(f"{a}.o_proj.weight", f"{a}.o_proj.weight", (hidden, heads * v_head), "row", shard_dim=1,
                          quantizable=True))
        m = f"model.layers.{i}.mlp"
        if is_moe_layer(arch, config, i):
            out.append(_whole(f"{m}.gate.weight", f"{m}.gate.weight", (num_experts, hidden), "replicated"))
            if noaux:
                out.append(_whole(f"{m}.gate.e_score_correction_bias", f"{m}.gate.e_score_correction_bias",
                                  (num_experts,), "replicated", dtype="float32"))
            else:
                unused[f"{m}.gate.e_score_correction_bias"] = "vLLM keeps no correction bias unless topk_method=noaux_tc"
            if num_shared:
                _mlp(f"{m}.shared_experts", f"{m}.shared_experts", hidden, moe_inter * num_shared, out)
            else:
                for n in ("gate_proj", "up_proj", "down_proj"):
                    unused[f"{m}.shared_experts.{n}.weight"] = "zero-sized: n_shared_experts=0"
            _experts(m, m, num_experts, hidden, moe_inter, out, expert_format(config))
        else:
            _mlp(m, m, hidden, inter, out)
        _norms(f"model.layers.{i}", hidden, out)
    _embed_head(config, out, unused)
    return _finish(arch, config, out, unused)


#: architecture -> builder of its vLLM name map.
BUILDERS: dict[str, Callable[[dict], NameMap]] = {
    "LlamaForCausalLM": llama_map,
    "Qwen3ForCausalLM": qwen3_map,
    "Qwen3MoeForCausalLM": qwen3_moe_map,
    "MixtralForCausalLM": mixtral_map,
    "DeepseekV3ForCausalLM": deepseek_v3_map,
}


def vllm_name_map(architecture: str, config: dict) -> NameMap | None:
    fn = BUILDERS.get(architecture)
    return None if fn is None else fn(config)
