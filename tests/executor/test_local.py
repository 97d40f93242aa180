"""The in-process reference executor: fused/sharded engine tensors equal what torch.cat and
slicing give, local offsets (ZeRO-3) and shaped local storage are honoured, and a plan meeting
other layouts is refused."""

from __future__ import annotations


import pytest
import torch

from fastsync.errors import PlanError
from fastsync.bench.local import (
    execute_plan_locally,
    gather_full,
    reference_engine_tensors,
    split_full_params,
    write_counts,
)
from fastsync.plan.planner import build_plan
from fastsync.bench.synthetic import ModelDims, engine_layout, fsdp_layout, small_model, zero3_layout

DIMS = ModelDims(layers=1, hidden=64, q_dim=64, kv_dim=32, inter=96, experts=4, moe_inter=32, vocab=64,
                 fused_experts=False, dtype="float32")



pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

def _full(params: dict) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {n: torch.randn(s.shape, generator=g) for n, s in params.items()}


def test_fused_qkv_and_experts_match_cat_and_slices() -> None:
    params = small_model(DIMS)
    full = _full(params)
    trainer = zero3_layout(params, 3)
    engine = engine_layout(params, DIMS, tp=2)
    plan = build_plan(params, trainer, engine)
    got = execute_plan_locally(plan, split_full_params(full, trainer), engine, trainer)
    a = "model.layers.0.self_attn."
    qkv = torch.cat([full[a + "q_proj.weight"][32:64], full[a + "k_proj.weight"][16:32], full[a + "v_proj.weight"][16:32]])
    assert torch.equal(got[1][a + "qkv_proj.weight"], qkv.to(torch.bfloat16))
    assert torch.equal(got[0][a + "o_proj.weight"], full[a + "o_proj.weight"][:, :32].to(torch.bfloat16))
    ex = "model.layers.0.mlp.experts."
    w13 = torch.stack([torch.cat([full[ex + f"{e}.gate_proj.weight"], full[ex + f"{e}.up_proj.weight"]]) for e in (2, 3)])
    assert torch.equal(got[1][ex + "w13_weight"], w13.to(torch.bfloat16))
    ref = reference_engine_tensors(full, engine)
    assert all(torch.equal(got[r][n], ref[r][n]) for r in ref for n in ref[r])


def test_zero3_offsets_and_shaped_storage_round_trip() -> None:
    params = small_model(DIMS)
    full = _full(params)
    trainer = zero3_layout(params, 5)
    locals_ = split_full_params(full, trainer)
    assert any(sh.local_offset > 0 for shards in trainer.shards.values() for sh in shards)
    for name in params:
        assert torch.equal(gather_full(name, trainer, locals_), full[name])
    fs = fsdp_layout(params, 2)
    shaped = {r: {n: t.view(-1, *params[n].shape[1:]) for n, t in d.items()} for r, d in split_full_params(full, fs).items()}
    engine = engine_layout(params, DIMS, tp=1)
    got = execute_plan_locally(build_plan(params, fs, engine), shaped, engine, fs)
    ref = reference_engine_tensors(full, engine)
    assert all(torch.equal(got[0][n], ref[0][n]) for n in ref[0])


def test_fp8_plan_with_gathers_is_bit_exact() -> None:
    dims = ModelDims(layers=1, hidden=256, q_dim=256, kv_dim=128, inter=256, experts=0, vocab=128)
    params = small_model(dims)
    full = {n: t.to(torch.bfloat16) for n, t in _full(params).items()}
    trainer = fsdp_layout(params, 3)  # 86-row chunks: blocks cut, owner gathers needed
    engine = engine_layout(params, dims, tp=2, fp8=True)
    plan = build_plan(params, trainer, engine)
    assert plan.gathers
    got = execute_plan_locally(plan, split_full_params(full, trainer), engine, trainer)
    ref = reference_engine_tensors(full, engine)
    for r in ref:
        for n in ref[r]:
            a, b = got[r][n], ref[r][n]
            if a.dtype == torch.float8_e4m3fn:
                a, b = a.view(torch.uint8), b.view(torch.uint8)
            assert torch.equal(a, b), (r, n)
    counts = write_counts(plan, engine)
    assert all(bool((c == 1).all()) for d in counts.values() for c in d.values())


def test_plan_for_other_layouts_or_missing_data_is_refused() -> None:
    params = small_model(DIMS)
    full = _full(params)
    trainer, engine = fsdp_layout(params, 2), engine_layout(params, DIMS, tp=1)
    plan = build_plan(params, trainer, engine)
    other = fsdp_layout(params, 3)
    with pytest.raises(PlanError, match="trainer layout"):
        execute_plan_locally(plan, split_full_params(full, other), engine, other)
    with pytest.raises(PlanError, match="trainer layout"):
        execute_plan_locally(plan, split_full_params(full, trainer), engine)
    short = split_full_params(full, trainer)
    name = "model.embed_tokens.weight"
    short[1][name] = short[1][name][:10]
    with pytest.raises(PlanError, match="rank 1"):
        execute_plan_locally(plan, short, engine, trainer)
