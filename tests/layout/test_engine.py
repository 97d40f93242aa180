"""Engine layouts rebuilt on real tensors equal an independent re-implementation of vLLM's
weight loaders (QKV with KV-head replication, merged gate/up, row parallel, padded vocab, fused
MoE with and without expert parallel); FP8 scale shapes follow vLLM's formulas."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from fastsync.errors import ConfigError, LayoutError  # noqa: E402
from fastsync.layout.box import box_slices  # noqa: E402
from fastsync.layout.engine import build_engine_layout, engine_tensors_for_rank, expert_range, scale_name  # noqa: E402
from fastsync.layout.namemap import NameMap, get_name_map  # noqa: E402
from fastsync.models import inventory_from_config, load_inventory  # noqa: E402

QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 100, "hidden_size": 32, "intermediate_size": 48,
    "moe_intermediate_size": 16, "num_experts": 6, "num_experts_per_tok": 2, "num_hidden_layers": 2,
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 8, "decoder_sparse_step": 1,
    "mlp_only_layers": [1], "attention_bias": True, "tie_word_embeddings": False,
}
DEEPSEEK = {
    "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 130, "hidden_size": 32, "intermediate_size": 40,
    "moe_intermediate_size": 8, "n_routed_experts": 5, "n_shared_experts": 1, "num_hidden_layers": 2,
    "first_k_dense_replace": 1, "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 24,
    "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 12, "topk_method": "noaux_tc",
}


def _full(inv, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(p.shape, generator=g) for n, p in inv.params.items()}


def _materialize(t, full):
    """The engine tensor as its pieces fill it; where the engine pads it (vocab rows), the
    padding must stay untouched and the logical prefix is returned."""
    out = torch.full(t.shape, float("nan"))
    for p in t.pieces:
        src = full[p.src][box_slices(p.src_box)]
        out[box_slices(p.dst_box)] = src.reshape(out[box_slices(p.dst_box)].shape)
    if t.logical_shape is not None:
        logical = tuple(slice(0, n) for n in t.logical_shape)
        assert torch.isnan(out).sum() == out.numel() - out[logical].numel(), t.name  # padding never filled
        out = out[logical]
    assert not torch.isnan(out).any(), t.name
    return out


# ---- an independent reference of vLLM 0.32's loaders -------------------------------------------


def _qkv_ref(q, k, v, heads, kv_heads, hd, tp, r):
    hl = heads // tp
    kvl = max(1, kv_heads // tp)
    rep = max(1, tp // kv_heads)
    s = r // rep
    return torch.cat([q[r * hl * hd:(r + 1) * hl * hd], k[s * kvl * hd:(s + 1) * kvl * hd],
                      v[s * kvl * hd:(s + 1) * kvl * hd]])


def _vocab_ref(w, tp, r):
    padded = -(-w.shape[0] // 64) * 64
    per = padded // tp
    return w[r * per:min((r + 1) * per, w.shape[0])]


def _w13_ref(gate_up, inter, moe_tp, r):
    g, u = gate_up[:, :inter], gate_up[:, inter:]
    return torch.cat([g.chunk(moe_tp, dim=1)[r], u.chunk(moe_tp, dim=1)[r]], dim=1)


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_qwen3_moe_tp_equals_vllm_loader_reference(tp):
    inv = inventory_from_config(QWEN3_MOE)
    nm = get_name_map(inv.architecture, inv.config, inv.params)
    full = _full(inv)
    for r in range(tp):
        ts = engine_tensors_for_rank(inv, nm, tp_size=tp, tp_rank=r, dtype="float32")
        a = "model.layers.0.self_attn"
        got = _materialize(ts[f"{a}.qkv_proj.weight"], full)
        want = _qkv_ref(full[f"{a}.q_proj.weight"], full[f"{a}.k_proj.weight"], full[f"{a}.v_proj.weight"], 8, 2, 8, tp, r)
        assert torch.equal(got, want)
        got = _materialize(ts[f"{a}.qkv_proj.bias"], full)
        want = _qkv_ref(full[f"{a}.q_proj.bias"], full[f"{a}.k_proj.bias"], full[f"{a}.v_proj.bias"], 8, 2, 8, tp, r)
        assert torch.equal(got, want)
        assert torch.equal(_materialize(ts[f"{a}.o_proj.weight"], full), full[f"{a}.o_proj.weight"].chunk(tp, 1)[r])
        assert torch.equal(_materialize(ts[f"{a}.o_proj.bias"], full), full[f"{a}.o_proj.bias"])
        assert torch.equal(_materialize(ts[f"{a}.q_norm.weight"], full), full[f"{a}.q_norm.weight"])
        m = "model.layers.0.mlp"
        w13 = _materialize(ts[f"{m}.experts.routed_experts.w13_weight"], full)
        assert torch.equal(w13, _w13_ref(full[f"{m}.experts.gate_up_proj"], 16, tp, r))
        w2 = _materialize(ts[f"{m}.experts.routed_experts.w2_weight"], full)
        assert torch.equal(w2, full[f"{m}.experts.down_proj"].chunk(tp, dim=2)[r])
        assert torch.equal(_materialize(ts[f"{m}.gate.weight"], full), full[f"{m}.gate.weight"])
        m = "model.layers.1.mlp"  # mlp_only_layers: a dense MLP
        want = torch.cat([full[f"{m}.gate_proj.weight"].chunk(tp)[r], full[f"{m}.up_proj.weight"].chunk(tp)[r]])
        assert torch.equal(_materialize(ts[f"{m}.gate_up_proj.weight"], full), want)
        assert torch.equal(_materialize(ts[f"{m}.down_proj.weight"], full), full[f"{m}.down_proj.weight"].chunk(tp, 1)[r])
        for n in ("model.embed_tokens.weight", "lm_head.weight"):
            want = _vocab_ref(full[n], tp, r)
            assert ts[n].shape == (-(-100 // 64) * 64 // tp, 32)  # every rank holds its padded slice
            if want.shape[0] == 0:  # all padding (vocab 100 -> 128 at tp 8: ranks 7): nothing to write
                assert ts[n].logical_shape == (0, 32) and ts[n].pieces == ()
            else:
                assert torch.equal(_materialize(ts[n], full), want)


@pytest.mark.parametrize("tp,dp", [(2, 1), (2, 3), (1, 4)])
def test_expert_parallel_places_whole_experts_linearly(tp, dp):
    inv = inventory_from_config(QWEN3_MOE)
    nm = get_name_map(inv.architecture, inv.config, inv.params)
    full = _full(inv)
    ep = tp * dp
    seen = []
    for d in range(dp):
        for r in range(tp):
            e = d * tp + r
            ts = engine_tensors_for_rank(inv, nm, tp_size=tp, tp_rank=r, ep_size=ep, ep_rank=e, dp_size=dp,
                                         dp_rank=d, dtype="float32")
            m = "model.layers.0.mlp"
            w13 = ts.get(f"{m}.experts.routed_experts.w13_weight")
            e0, e1 = expert_range(6, ep, e)
            if e1 == e0:
                assert w13 is None
                continue
            assert torch.equal(_materialize(w13, full), full[f"{m}.experts.gate_up_proj"][e0:e1])
            assert torch.equal(_materialize(ts[f"{m}.experts.routed_experts.w2_weight"], full),
                               full[f"{m}.experts.down_proj"][e0:e1])
            seen.extend(range(e0, e1))
            # dense weights stay tensor parallel over tp only
            a = "model.layers.0.self_attn"
            assert torch.equal(_materialize(ts[f"{a}.o_proj.weight"], full), full[f"{a}.o_proj.weight"].chunk(tp, 1)[r])
    assert sorted(seen) == list(range(6))
    assert expert_range(6, 4, 0) == (0, 2) and expert_range(6, 4, 3) == (5, 6)  # remainder to the first ranks


def test_moe_without_ep_is_tensor_parallel_across_dp():
    inv = inventory_from_config(QWEN3_MOE)
    nm = get_name_map(inv.architecture, inv.config, inv.params)
    full = _full(inv)
    lay = build_engine_layout(inv, nm, tp=2, dp=2, dtype="float32")
    m = "model.layers.0.mlp"
    for rank in range(4):  # flattened moe tp rank = dp_rank * tp + tp_rank = rank
        w13 = _materialize(lay.tensors[rank][f"{m}.experts.routed_experts.w13_weight"], full)
        assert torch.equal(w13, _w13_ref(full[f"{m}.experts.gate_up_proj"], 16, 4, rank))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_deepseek_mla_equals_reference(tp):
    inv = inventory_from_config(DEEPSEEK)
    nm = get_name_map(inv.architecture, inv.config, inv.params)
    full = _full(inv, seed=1)
    for r in range(tp):
        ts = engine_tensors_for_rank(inv, nm, tp_size=tp, tp_rank=r, dtype="float32")
        a = "model.layers.1.self_attn"
        fused = torch.cat([full[f"{a}.q_a_proj.weight"], full[f"{a}.kv_a_proj_with_mqa.weight"]])
        assert torch.equal(_materialize(ts[f"{a}.fused_qkv_a_proj.weight"], full), fused)
        assert torch.equal(_materialize(ts[f"{a}.q_b_proj.weight"], full), full[f"{a}.q_b_proj.weight"].chunk(tp)[r])
        assert torch.equal(_materialize(ts[f"{a}.kv_b_proj.weight"], full), full[f"{a}.kv_b_proj.weight"].chunk(tp)[r])
        assert torch.equal(_materialize(ts[f"{a}.o_proj.weight"], full), full[f"{a}.o_proj.weight"].chunk(tp, 1)[r])
        m = "model.layers.1.mlp"
        bias = ts[f"{m}.gate.e_score_correction_bias"]
        assert bias.dtype == "float32" and torch.equal(_materialize(bias, full), full[f"{m}.gate.e_score_correction_bias"])
        sh = f"{m}.shared_experts"
        want = torch.cat([full[f"{sh}.gate_proj.weight"].chunk(tp)[r], full[f"{sh}.up_proj.weight"].chunk(tp)[r]])
        assert torch.equal(_materialize(ts[f"{sh}.gate_up_proj.weight"], full), want)
        assert "model.layers.0.mlp.gate_up_proj.weight" in ts  # first_k_dense_replace=1


def test_layout_validates_and_shares_replicas():
    inv = inventory_from_config(QWEN3_MOE)
    nm = get_name_map(inv.architecture, inv.config, inv.params)
    lay = build_engine_layout(inv, nm, tp=2, dp=2, ep=True, replicas=3)
    assert lay.world_size == 12 and lay.replica_of[11] == 2 and lay.replica_of[3] == 0
    lay.validate(inv.params)
    assert lay.tensors[1] is lay.tensors[5]  # same position in another replica: identical tensors
    with pytest.raises(ConfigError, match=r"ep=3.*tp\*dp = 4"):
        build_engine_layout(inv, nm, tp=2, dp=2, ep=3)


def test_fp8_kimi_k2_scale_shapes_follow_vllm():
    inv = load_inventory("kimi-k2")
    nm = get_name_map(inv.architecture, inv.config, inv.params)
    ts = engine_tensors_for_rank(inv, nm, tp_size=8, tp_rank=3, ep_size=32, ep_rank=11, dp_size=4, dp_rank=1,
                                 quant="fp8")
    a, m = "model.layers.5.self_attn", "model.layers.5.mlp"
    cases = {
        f"{a}.fused_qkv_a_proj.weight": ((1536 + 576, 7168), (17, 56)),
        f"{a}.q_b_proj.weight": ((8 * 192, 1536), (12, 12)),
        f"{a}.kv_b_proj.weight": ((8 * 256, 512), (16, 4)),
        f"{a}.o_proj.weight": ((7168, 8 * 128), (56, 8)),
        f"{m}.shared_experts.gate_up_proj.weight": ((2 * 256, 7168), (4, 56)),
        f"{m}.experts.routed_experts.w13_weight": ((12, 4096, 7168), (12, 2 * 16, 56)),
        f"{m}.experts.routed_experts.w2_weight": ((12, 7168, 2048), (12, 56, 16)),
    }
    for name, (wshape, sshape) in cases.items():
        assert ts[name].dtype == "float8_e4m3fn" and ts[name].shape == wshape, name
        s = ts[scale_name(name)]
        assert s.dtype == "float32" and s.shape == sshape, (name, s.shape)
        assert all(p.transform == "fp8_scale" for p in s.pieces)
        assert all(p.transform == "fp8_block" for p in ts[name].pieces)
    assert scale_name(f"{m}.experts.routed_experts.w13_weight").endswith("w13_weight_scale_inv")
    for keep in ("model.embed_tokens.weight", "lm_head.weight", f"{m}.gate.weight", f"{a}.kv_a_layernorm.weight"):
        assert ts[keep].dtype in ("bfloat16",) and scale_name(keep) not in ts
    assert ts[f"{m}.gate.e_score_correction_bias"].dtype == "float32"


def test_fp8_scale_pieces_cover_their_weight_region():
    inv = load_inventory("qwen3-30b-a3b")
    nm = get_name_map(inv.architecture, inv.config, inv.params)
    ts = engine_tensors_for_rank(inv, nm, tp_size=2, tp_rank=1, quant="fp8")
    for name, t in ts.items():
        if t.dtype != "float8_e4m3fn":
            continue
        s = ts[scale_name(name)]
        for wp, sp in zip(t.pieces, s.pieces):
            assert sp.src_box == wp.src_box
            rows, cols = (b - a for a, b in wp.dst_box[-2:])
            srows, scols = (b - a for a, b in sp.dst_box[-2:])
            assert (srows, scols) == (math.ceil(rows / 128), math.ceil(cols / 128))
    build_engine_layout(inv, nm, tp=2, quant="fp8").validate(inv.params)


def test_fp8_block_straddling_two_params_is_refused():
    cfg = dict(QWEN3_MOE, head_dim=64, num_attention_heads=4, num_key_value_heads=2, hidden_size=256,
               attention_bias=False)
    inv = inventory_from_config(cfg)
    nm = get_name_map(inv.architecture, inv.config, inv.params)
    with pytest.raises(LayoutError, match=r"qkv_proj.weight.*straddle.*k_proj"):
        engine_tensors_for_rank(inv, nm, tp_size=2, tp_rank=0, quant="fp8")


def test_name_map_errors_name_the_tensor():
    inv = inventory_from_config(QWEN3_MOE)
    nm = get_name_map(inv.architecture, inv.config)
    extra = dict(inv.params)
    from fastsync.layout.types import ParamSpec

    extra["model.layers.0.mlp.mystery.weight"] = ParamSpec("model.layers.0.mlp.mystery.weight", (4, 4))
    with pytest.raises(LayoutError, match=r"'model.layers.0.mlp.mystery.weight' maps to no vllm tensor"):
        nm.validate(extra)
    short = NameMap(nm.architecture, nm.engine, [p for p in nm.params if "o_proj.weight" not in p.name], nm.unused)
    with pytest.raises(LayoutError, match=r"o_proj.weight' maps to no vllm tensor"):
        short.validate(inv.params)
    missing = dict(inv.params)
    del missing["model.layers.0.self_attn.k_proj.weight"]
    with pytest.raises(LayoutError, match=r"qkv_proj.weight' reads trainer parameter 'model.layers.0.self_attn.k_proj"):
        nm.validate(missing)
    with pytest.raises(LayoutError, match="no name map for architecture 'GPT2LMHeadModel'"):
        get_name_map("GPT2LMHeadModel", {})


def test_tied_lm_head_is_declared_not_silently_skipped():
    inv = load_inventory("qwen3-0.6b")
    nm = get_name_map(inv.architecture, inv.config, inv.params)
    assert "lm_head.weight" in nm.unused and "lm_head.weight" not in nm.by_name()


def test_kv_heads_that_do_not_divide_tp_are_refused():
    inv = inventory_from_config(dict(QWEN3_MOE, num_key_value_heads=3, num_attention_heads=12))
    nm = get_name_map(inv.architecture, inv.config, inv.params)
    with pytest.raises(LayoutError, match=r"qkv_proj.weight.*tensor parallel size 4 is not a multiple of its 3 heads"):
        engine_tensors_for_rank(inv, nm, tp_size=4, tp_rank=0)


@pytest.mark.parametrize("tp,ep", [(1, 1), (2, 1), (2, 2), (1, 4)])
def test_per_expert_sources_fill_the_same_fused_tensors(tp, ep):
    fused = inventory_from_config(QWEN3_MOE)
    split = inventory_from_config(QWEN3_MOE, fused_experts=False)
    assert "model.layers.0.mlp.experts.5.up_proj.weight" in split.params
    assert "model.layers.0.mlp.experts.gate_up_proj" not in split.params
    nm_f = get_name_map(fused.architecture, fused.config, fused.params)
    nm_s = get_name_map(split.architecture, split.config, split.params)
    full_f = _full(fused)
    full_s = dict(full_f)
    m = "model.layers.0.mlp.experts"
    gu, down = full_s.pop(f"{m}.gate_up_proj"), full_s.pop(f"{m}.down_proj")
    for e in range(6):
        full_s[f"{m}.{e}.gate_proj.weight"] = gu[e, :16]
        full_s[f"{m}.{e}.up_proj.weight"] = gu[e, 16:]
        full_s[f"{m}.{e}.down_proj.weight"] = down[e]
    lay_f = build_engine_layout(fused, nm_f, tp=tp, ep=ep, dtype="float32")
    lay_s = build_engine_layout(split, nm_s, tp=tp, ep=ep, dtype="float32")
    for rank in range(lay_f.world_size):
        for name in ("model.layers.0.mlp.experts.routed_experts.w13_weight",
                     "model.layers.0.mlp.experts.routed_experts.w2_weight"):
            a, b = lay_f.tensors[rank].get(name), lay_s.tensors[rank].get(name)
            assert (a is None) == (b is None)
            if a is not None:
                assert torch.equal(_materialize(a, full_f), _materialize(b, full_s)), (rank, name)


class _OverrideMap:
    """A third-party name map for Llama that renames the final norm (registered at run time)."""

    @staticmethod
    def _build(config):
        from fastsync.engines.vllm.names import llama_map

        nm = llama_map(config)
        for i, p in enumerate(nm.params):
            if p.name == "model.norm.weight":
                nm.params[i] = type(p)("model.final_norm.weight", p.shape, p.style, p.segments)
        return nm

    from fastsync import hookimpl

    @hookimpl
    def fastsync_name_map(self, architecture, config):
        return self._build(config) if architecture == "LlamaForCausalLM" else None


def test_third_party_name_map_wins_over_builtin():
    from fastsync import plugins

    inv = load_inventory("llama-3-8b")
    name = plugins.register_plugin(_OverrideMap(), name="override_map")
    try:
        nm = get_name_map(inv.architecture, inv.config, inv.params)
        assert "model.final_norm.weight" in nm.by_name() and "model.norm.weight" not in nm.by_name()
        qwen = load_inventory("qwen3-0.6b")
        assert "model.norm.weight" in get_name_map(qwen.architecture, qwen.config).by_name()
    finally:
        plugins.unregister_plugin(name)
    assert "model.norm.weight" in get_name_map(inv.architecture, inv.config).by_name()


def test_bad_rank_coordinates_are_config_errors():
    inv = inventory_from_config(QWEN3_MOE)
    nm = get_name_map(inv.architecture, inv.config)
    with pytest.raises(ConfigError, match="tp rank 2 outside tp size 2"):
        engine_tensors_for_rank(inv, nm, tp_size=2, tp_rank=2)
    with pytest.raises(ConfigError, match="quant 'int4' unknown"):
        engine_tensors_for_rank(inv, nm, tp_size=1, tp_rank=0, quant="int4")
    with pytest.raises(ConfigError, match="ep=3 is not a multiple of tp=2"):
        build_engine_layout(inv, nm, tp=2, ep=3)


def test_vllm_rank_coords_reproduce_the_whole_engine_layout():
    from fastsync.layout.engine import vllm_rank_coords

    inv = inventory_from_config(QWEN3_MOE)
    nm = get_name_map(inv.architecture, inv.config, inv.params)
    for ep in (False, True):
        lay = build_engine_layout(inv, nm, tp=2, dp=2, ep=ep)
        for dp_rank in range(2):
            for tp_rank in range(2):
                kw = vllm_rank_coords(tp_size=2, tp_rank=tp_rank, dp_size=2, dp_rank=dp_rank,
                                      enable_expert_parallel=ep)
                mine = engine_tensors_for_rank(inv, nm, **kw)
                assert mine == lay.tensors[dp_rank * 2 + tp_rank]
