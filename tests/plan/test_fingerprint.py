"""The fast fingerprints equal the contracts' own (layouts' fingerprint(), Plan.json_hash(), which
``Plan.plan_hash`` answers through the fast one)."""

from __future__ import annotations

import dataclasses

from hypothesis import given, settings
from hypothesis import strategies as st

from fastsync.layout.types import EngineLayout, EngineTensor, ParamSpec, Piece, Shard, TrainerLayout
from fastsync.plan.fingerprint import engine_fingerprint, plan_hash, trainer_fingerprint
from fastsync.plan.planner import build_plan
from fastsync.bench.synthetic import ModelDims, engine_layout, fsdp_layout, megatron_layout, small_model, zero3_layout


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 2), st.sampled_from([0, 4]), st.sampled_from(["fsdp", "zero3", "megatron"]),
       st.integers(1, 5), st.sampled_from([1, 2]), st.integers(1, 12), st.booleans())
def test_fast_fingerprints_equal_contract_ones(layers: int, experts: int, kind: str, n: int, tp: int, reps: int,
                                               fp8: bool) -> None:
    dims = ModelDims(layers=layers, experts=experts, hidden=128, q_dim=128, kv_dim=64, moe_inter=64)
    params = small_model(dims)
    trainer = {"fsdp": lambda: fsdp_layout(params, n), "zero3": lambda: zero3_layout(params, n),
               "megatron": lambda: megatron_layout(params, tp, n, 1)}[kind]()
    engine = engine_layout(params, dims, tp=tp, replicas=reps, fp8=fp8)  # reps >= 10: "10" sorts before "2"
    assert trainer_fingerprint(trainer) == trainer.fingerprint()
    assert engine_fingerprint(engine) == engine.fingerprint()
    plan = build_plan(params, trainer, engine)
    assert plan.trainer_hash == trainer.fingerprint() and plan.engine_hash == engine.fingerprint()
    assert plan_hash(plan) == plan.json_hash() == plan.plan_hash


def test_names_needing_json_escapes() -> None:
    name = 'w"\\ü\n'
    params = {name: ParamSpec(name, (4, 2))}
    trainer = TrainerLayout(2, dict(params), {name: (Shard(0, ((0, 2), (0, 2))), Shard(1, ((2, 4), (0, 2))))}, kind="x\"y")
    full = ((0, 4), (0, 2))
    engine = EngineLayout(1, {0: {"é": EngineTensor("é", (4, 2), "float32", (Piece(full, name, full),))}}, {0: 0}, "k\\")
    assert trainer_fingerprint(trainer) == trainer.fingerprint()
    assert engine_fingerprint(engine) == engine.fingerprint()
    plan = build_plan(params, trainer, engine)
    assert plan_hash(plan) == plan.json_hash() == plan.plan_hash
    moved = dataclasses.replace(plan.transfers[0], src_rank=1 - plan.transfers[0].src_rank)
    plan.transfers[0] = moved
    assert plan_hash(plan) == plan.json_hash() == plan.plan_hash
