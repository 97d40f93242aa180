"""Engine replicas as reload sources: their engine tensors become source boxes that the planner
moves into any other engine layout, bit for bit (in-process executor, real vLLM name maps)."""

from __future__ import annotations

import pytest
import torch

from fastsync.demo.checkpoints import tiny_config
from fastsync.errors import LayoutError
from fastsync.layout.spec import engine_layout_from_spec
from fastsync.layout.types import EngineTensor, Piece
from fastsync.models.inventory import inventory_from_config
from fastsync.reload.plans import PlanCache
from fastsync.reload.source import (
    HolderRanks,
    engine_source_layout,
    local_shards,
    merge_sources,
    params_of,
    target_layout,
)
from fastsync.bench.local import execute_plan_locally, reference_engine_tensors


def _inventory(preset: str, **over):
    arch, cfg = tiny_config(preset)
    cfg = {**cfg, "architectures": [arch], **over}
    return inventory_from_config(cfg, name=arch, dtype="bfloat16")


def _replicas(layout, n_ranks):
    return [dict(layout.tensors[r]) for r in range(n_ranks)]


# awkward sizes: hidden 192, intermediate 200, vocab 515 (vLLM pads it)
@pytest.mark.parametrize("preset,src_spec,src_n,dst_spec,dst_n", [
    ("tiny-qwen3", "vllm:tp2", 2, "vllm:tp1", 1),
    ("tiny-qwen3", "vllm:tp1", 1, "vllm:tp2", 2),
    ("tiny-qwen3-moe", "vllm:tp2", 2, "vllm:tp1", 1),
    # vLLM-CPU's MoE padding on both sides (72 -> 96 at tp1, 36 -> 64 per rank at tp2): padded
    # holders are sources, padded joiners targets, the padding is neither read nor written. (A
    # padded w2_weight's logical box is one run per (expert, row): smaller model, one layer.)
    ("tiny-qwen3-moe", "vllm:tp2,moepad32", 2, "vllm:tp1,moepad32", 1),
])
def test_holder_layout_moves_bit_exact(preset, src_spec, src_n, dst_spec, dst_n):
    over = {"hidden_size": 192, "intermediate_size": 200, "vocab_size": 515}
    if preset.endswith("moe"):
        over["moe_intermediate_size"] = 72
    if "moepad" in src_spec:
        over.update(hidden_size=96, num_hidden_layers=1, num_experts=5)
    inv = _inventory(preset, **over)
    src = engine_layout_from_spec(src_spec, inv)
    dst = engine_layout_from_spec(dst_spec, inv)
    g = torch.Generator().manual_seed(3)
    full = {n: torch.randn(p.shape, generator=g).to(torch.bfloat16) for n, p in inv.params.items()}
    held = reference_engine_tensors(full, src)  # what the holder engine's tensors hold
    want = reference_engine_tensors(full, dst)
    target = target_layout(_replicas(dst, dst_n))
    params = params_of(target.tensors)
    # two holder replicas of the source layout: the planner spreads the bytes over both
    holders = [HolderRanks("A", tuple(_replicas(src, src_n))), HolderRanks("B", tuple(_replicas(src, src_n)))]
    source = engine_source_layout(holders, params)
    cache = PlanCache()
    plan = cache.get(params, source, target)
    assert cache.get(params, source, target) is plan and (cache.hits, cache.misses) == (1, 1)
    # each source rank's local buffers are its engine tensors (flat), as the holder's worker passes them
    locals_ = {}
    for r in range(source.world_size):
        h, i = divmod(r, src_n)
        shards, buffer_of = local_shards(holders[h].tensors[i], r)
        locals_[r] = {p: held[i][t] for p, t in buffer_of.items()}
    got = execute_plan_locally(plan, locals_, target, source)
    for r in range(dst_n):
        for n, t in want[r].items():
            assert torch.equal(got[r][n], t), (r, n)
    senders = {t.src_rank for t in plan.transfers}
    assert senders & set(range(src_n)) and senders & set(range(src_n, 2 * src_n)), "load not spread"


def test_quantised_holder_is_refused():
    t = EngineTensor("w", (4, 4), "float8_e4m3fn", (Piece(((0, 4), (0, 4)), "p", ((0, 4), (0, 4)), "fp8_block"),))
    with pytest.raises(LayoutError, match="transform 'fp8_block'"):
        local_shards({"w": t}, 0)


def test_parameter_in_two_buffers_is_refused():
    a = EngineTensor("a", (2, 4), "bfloat16", (Piece(((0, 2), (0, 4)), "p", ((0, 2), (0, 4))),))
    b = EngineTensor("b", (2, 4), "bfloat16", (Piece(((0, 2), (0, 4)), "p", ((2, 4), (0, 4))),))
    with pytest.raises(LayoutError, match="two engine tensors"):
        local_shards({"a": a, "b": b}, 0)


def test_trainer_and_engine_holders_merge():
    from fastsync.bench.synthetic import fsdp_layout
    from fastsync.bench.local import split_full_params

    inv = _inventory("tiny-qwen3", hidden_size=192, intermediate_size=200, vocab_size=515)
    src = engine_layout_from_spec("vllm:tp2", inv)
    dst = engine_layout_from_spec("vllm:tp1", inv)
    g = torch.Generator().manual_seed(5)
    full = {n: torch.randn(p.shape, generator=g).to(torch.bfloat16) for n, p in inv.params.items()}
    target = target_layout(_replicas(dst, 1))
    params = params_of(target.tensors)
    trainer = fsdp_layout({n: inv.params[n] for n in params}, 3)
    engine = engine_source_layout([HolderRanks("E", tuple(_replicas(src, 2)))], params)
    merged = merge_sources([trainer, engine], params)
    assert merged.world_size == 5
    plan = PlanCache().get(params, merged, target)
    held = reference_engine_tensors(full, src)
    locals_ = split_full_params({n: full[n] for n in params}, trainer)
    for i in range(2):
        _, buffer_of = local_shards(src.tensors[i], 3 + i)
        locals_[3 + i] = {p: held[i][t] for p, t in buffer_of.items()}
    got = execute_plan_locally(plan, locals_, target, merged)
    want = reference_engine_tensors(full, dst)
    for n, t in want[0].items():
        assert torch.equal(got[0][n], t), n
    assert {t.src_rank for t in plan.transfers} & {0, 1, 2} and {t.src_rank for t in plan.transfers} & {3, 4}
