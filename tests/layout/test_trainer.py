"""Trainer layouts from settings: boxes equal what torch.chunk / DeepSpeed's flat partitions /
Megatron's splits hold, on real tensors."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from fastsync.errors import ConfigError, LayoutError  # noqa: E402
from fastsync.layout.box import box_slices  # noqa: E402
from fastsync.layout.trainer import fsdp_layout, hsdp_layout, megatron_layout, replicated_layout, zero3_layout  # noqa: E402
from fastsync.layout.types import ParamSpec, Shard, TrainerLayout  # noqa: E402
from fastsync.models import inventory_from_config, load_inventory  # noqa: E402

CFG = {
    "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 1000, "hidden_size": 32, "intermediate_size": 48,
    "moe_intermediate_size": 16, "num_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 4,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 8, "tie_word_embeddings": False,
}


def _full(inv):
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(p.shape, generator=g) for n, p in inv.params.items()}


@pytest.mark.parametrize("world", [1, 3, 8, 33])
def test_fsdp_boxes_are_torch_chunk(world):
    inv = inventory_from_config(CFG)
    lay = fsdp_layout(inv, world)
    full = _full(inv)
    for name, t in full.items():
        chunks = t.chunk(world, dim=0)
        got = {s.rank: t[box_slices(s.box)] for s in lay.shards[name]}
        for r in range(world):
            want = chunks[r] if r < len(chunks) else t[:0]
            if want.numel():
                assert torch.equal(got[r], want) and lay.shards[name][0].local_offset == 0
            else:
                assert r not in got


def test_hsdp_shards_within_each_replica_group():
    inv = inventory_from_config(CFG)
    lay = hsdp_layout(inv, 2, 3)
    assert lay.world_size == 6
    name = "model.layers.0.mlp.experts.gate_up_proj"
    boxes = {s.rank: s.box for s in lay.shards[name]}
    assert boxes[0] == boxes[3] and boxes[2] == boxes[5] and boxes[0] != boxes[1]
    assert boxes[0][0] == (0, 3) and boxes[2][0] == (6, 8)


@pytest.mark.parametrize("world", [1, 4, 7])
def test_zero3_boxes_rebuild_deepspeed_flat_partitions(world):
    inv = inventory_from_config(CFG)
    lay = zero3_layout(inv, world)
    full = _full(inv)
    for name, t in full.items():
        flat = t.flatten()
        part = -(-flat.numel() // world)
        for r in range(world):
            want = flat[r * part:(r + 1) * part]  # DeepSpeed pads the tail; the padding holds no bytes
            mine = [s for s in lay.shards[name] if s.rank == r]
            local = torch.full((want.numel(),), float("nan"))
            for s in mine:
                piece = t[box_slices(s.box)].flatten()
                local[s.local_offset:s.local_offset + piece.numel()] = piece
            assert torch.equal(local, want), (name, r)


def test_megatron_tp_pp_ep_dp():
    inv = inventory_from_config(CFG)
    lay = megatron_layout(inv, tp=2, pp=2, ep=4, dp=2)
    assert lay.world_size == 8
    full = _full(inv)
    # layer 0 on stage 0 (ranks 0-3), layer 3 on stage 1 (ranks 4-7); rank = (pp*dp + dp_rank)*tp + tp_rank
    q = "model.layers.3.self_attn.q_proj.weight"
    by_rank = {s.rank: s.box for s in lay.shards[q]}
    assert sorted(by_rank) == [4, 5, 6, 7]
    assert torch.equal(full[q][box_slices(by_rank[5])], full[q].chunk(2)[1])
    assert by_rank[4] == by_rank[6]  # replicated over dp
    o = "model.layers.0.self_attn.o_proj.weight"
    assert {s.rank: s.box for s in lay.shards[o]}[1] == ((0, 32), (32, 64))  # row parallel: input dim
    e = "model.layers.0.mlp.experts.gate_up_proj"
    experts = {s.rank: s.box[0] for s in lay.shards[e]}
    assert experts == {0: (0, 2), 1: (2, 4), 2: (4, 6), 3: (6, 8)}  # ep=4 over the stage's 4 ranks, etp=1
    assert {s.rank for s in lay.shards["model.embed_tokens.weight"]} == {0, 1, 2, 3}
    assert {s.rank for s in lay.shards["lm_head.weight"]} == {4, 5, 6, 7}


def test_megatron_fused_expert_tp_holds_two_boxes_per_rank():
    inv = inventory_from_config(CFG)
    lay = megatron_layout(inv, tp=2)
    full = _full(inv)
    name = "model.layers.0.mlp.experts.gate_up_proj"
    mine = sorted((s for s in lay.shards[name] if s.rank == 1), key=lambda s: s.local_offset)
    local = torch.cat([full[name][box_slices(s.box)] for s in mine], dim=1)
    g, u = full[name][:, :16], full[name][:, 16:]
    assert torch.equal(local, torch.cat([g.chunk(2, 1)[1], u.chunk(2, 1)[1]], dim=1))
    assert mine[1].local_offset == mine[0].box[0][1] * 8 * 32


def test_replicated_and_bad_settings():
    inv = inventory_from_config(CFG)
    lay = replicated_layout(inv, 3)
    assert all(len(s) == 3 for s in lay.shards.values())
    with pytest.raises(ConfigError, match="world_size must be a positive integer"):
        fsdp_layout(inv, 0)
    with pytest.raises(ConfigError, match=r"ep=3 must divide tp\*dp=4"):
        megatron_layout(inv, tp=2, dp=2, ep=3)
    with pytest.raises(ConfigError, match="pp=9 exceeds"):
        megatron_layout(inv, tp=1, pp=9)


def test_uncovered_parameter_is_named():
    params = {"a": ParamSpec("a", (4, 4)), "b": ParamSpec("b", (4,))}
    lay = TrainerLayout(2, params, {"a": (Shard(0, ((0, 2), (0, 4))),), "b": (Shard(1, ((0, 4),)),)})
    with pytest.raises(LayoutError, match="covers 8 of 16 elements of parameter 'a'"):
        lay.validate()


def test_kimi_fsdp256_shares_shard_tuples():
    inv = load_inventory("kimi-k2")
    lay = fsdp_layout(inv, 256)
    a, b = "model.layers.3.mlp.experts.gate_up_proj", "model.layers.9.mlp.experts.gate_up_proj"
    # torch.chunk: 384 experts in chunks of 2 fill 192 ranks; the last 64 hold no expert bytes
    assert lay.shards[a] is lay.shards[b] and len(lay.shards[a]) == 192
    assert lay.shards["model.layers.3.input_layernorm.weight"][-1].box == ((7140, 7168),)


def test_check_params_names_the_disagreeing_parameter():
    from fastsync.layout.trainer import check_params

    inv = inventory_from_config(CFG)
    lay = fsdp_layout(inv, 2)
    check_params(lay, inv)
    other = inventory_from_config(dict(CFG, vocab_size=1001))
    with pytest.raises(LayoutError, match=r"'model.embed_tokens.weight': trainer layout shape \(1000, 32\) disagrees"):
        check_params(lay, other)
    fewer = inventory_from_config(dict(CFG, num_hidden_layers=3))
    with pytest.raises(LayoutError, match=r"has parameter 'model.layers.3.self_attn.q_proj.weight' the model does not"):
        check_params(lay, fewer)
    with pytest.raises(LayoutError, match=r"lacks parameter 'model.layers.3"):
        check_params(fsdp_layout(fewer, 2), inv)
