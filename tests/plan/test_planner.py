"""Planner behaviour on hand-picked layouts: direct slicing, owner gathers, replica balancing,
chunking, serialisation, and bad input refused before planning with the culprit named."""

from __future__ import annotations

import dataclasses

import pytest

from fastsync.errors import FastSyncError, LayoutError, PlanError
from fastsync.layout.box import box_numel
from fastsync.layout.types import EngineLayout, EngineTensor, ParamSpec, Piece, Shard, TrainerLayout
from fastsync.plan.planner import build_plan
from fastsync.bench.synthetic import ModelDims, engine_layout, fsdp_layout, small_model
from fastsync.plan.types import Plan

DIMS = ModelDims(layers=1, hidden=256, q_dim=256, kv_dim=128, inter=256, experts=4, moe_inter=128, vocab=128)


def _model() -> dict[str, ParamSpec]:
    return small_model(DIMS)


def test_fsdp_rows_onto_column_parallel_are_sliced_without_gather() -> None:
    params = _model()
    plan = build_plan(params, fsdp_layout(params, 4), engine_layout(params, DIMS, tp=2))
    assert plan.gathers == {} and not any(t.gathered for t in plan.transfers)
    # q_proj rows 0..128 (TP rank 0) come from FSDP ranks 0 and 1 (64 rows each), into qkv rows 0..128
    q = sorted((t.src_rank, t.src_box, t.dst_box) for t in plan.transfers
               if t.src_param.endswith("q_proj.weight") and t.dst_rank == 0)
    assert q == [(0, ((0, 64), (0, 256)), ((0, 64), (0, 256))), (1, ((64, 128), (0, 256)), ((64, 128), (0, 256)))]


def test_fp8_blocks_cut_by_shards_are_gathered_on_spread_owners() -> None:
    params = _model()
    trainer = fsdp_layout(params, 4)  # 64-row shards cut 128-row blocks
    engine = engine_layout(params, DIMS, tp=2, fp8=True)
    plan = build_plan(params, trainer, engine)
    assert "model.layers.0.self_attn.q_proj.weight" in plan.gathers
    owners = set(plan.gathers.values())
    assert len(owners) > 1, plan.gathers  # owners are spread, not all on rank 0
    for t in plan.transfers:
        assert t.gathered == (t.src_param in plan.gathers and t.transform != "copy")
        if t.gathered:
            assert t.src_rank == plan.gathers[t.src_param]
    # 128-row shards keep blocks whole: no gather at all
    assert build_plan(params, fsdp_layout(params, 2), engine).gathers == {}


def test_hsdp_replicas_split_the_sending() -> None:
    params = _model()
    plan = build_plan(params, fsdp_layout(params, 2, replicas=2), engine_layout(params, DIMS, tp=2, replicas=2))
    send = plan.send_bytes()
    assert all(s > 0 for s in send)
    assert max(send) / (sum(send) / len(send)) < 1.05, send


def test_max_transfer_bytes_splits_into_chunks_on_block_rows() -> None:
    params = _model()
    trainer, engine = fsdp_layout(params, 1), engine_layout(params, DIMS, tp=1, fp8=True)
    whole = build_plan(params, trainer, engine)
    chunked = build_plan(params, trainer, engine, max_transfer_bytes=128 * 256)
    assert len(chunked.transfers) > len(whole.transfers)
    assert chunked.bytes_total == whole.bytes_total
    assert max(t.nbytes for t in chunked.transfers if t.transform != "fp8_scale") <= 128 * 256
    for t in chunked.transfers:
        if t.transform == "fp8_block" and len(t.src_box) == 2:
            assert t.src_box[0][0] % 128 == 0


def test_round_trip_and_check_layouts() -> None:
    params = _model()
    trainer, engine = fsdp_layout(params, 3), engine_layout(params, DIMS, tp=2, fp8=True)
    plan = build_plan(params, trainer, engine)
    back = Plan.loads(plan.dumps())
    assert back.transfers == plan.transfers and back.gathers == plan.gathers and back.meta == plan.meta
    assert back.plan_hash == plan.plan_hash
    back.check_layouts(trainer.fingerprint(), engine.fingerprint())
    with pytest.raises(PlanError, match="trainer layout"):
        back.check_layouts(fsdp_layout(params, 4).fingerprint(), engine.fingerprint())
    with pytest.raises(PlanError, match="not a serialised fastsync plan"):
        Plan.loads('{"transfers": 3}')


def test_same_inputs_same_hash_different_layout_different_hash() -> None:
    params = _model()
    engine = engine_layout(params, DIMS, tp=2)
    a = build_plan(params, fsdp_layout(params, 4), engine)
    b = build_plan(params, fsdp_layout(params, 4), engine)
    c = build_plan(params, fsdp_layout(params, 4, dim=1), engine)
    d = build_plan(params, fsdp_layout(params, 4), engine_layout(params, DIMS, tp=4))
    assert a.plan_hash == b.plan_hash
    assert len({a.plan_hash, c.plan_hash, d.plan_hash}) == 3


# ---- bad input ------------------------------------------------------------------------------


def test_uncovered_parameter_is_named() -> None:
    params = _model()
    trainer = fsdp_layout(params, 2)
    victim = "model.layers.0.self_attn.k_proj.weight"
    trainer.shards[victim] = trainer.shards[victim][:1]  # rank 1's half is missing
    with pytest.raises(LayoutError, match=r"k_proj"):
        build_plan(params, trainer, engine_layout(params, DIMS, tp=1))
    del trainer.shards[victim]
    with pytest.raises(LayoutError, match=r"k_proj"):
        build_plan(params, trainer, engine_layout(params, DIMS, tp=1))


def test_shape_mismatch_is_named() -> None:
    params = _model()
    trainer = fsdp_layout(params, 2)
    name = "model.layers.0.self_attn.o_proj.weight"
    wrong = dict(params)
    wrong[name] = ParamSpec(name, (256, 128))
    with pytest.raises(LayoutError, match="o_proj.*shape"):
        build_plan(wrong, trainer, engine_layout(params, DIMS, tp=1))


def test_unknown_name_in_engine_is_named() -> None:
    params = _model()
    engine = engine_layout(params, DIMS, tp=1)
    t = engine.tensors[0]["model.norm.weight"]
    bad = dataclasses.replace(t, pieces=(dataclasses.replace(t.pieces[0], src="model.nrom.weight"),))
    engine.tensors[0]["model.norm.weight"] = bad
    with pytest.raises(LayoutError, match="model.nrom.weight"):
        build_plan(params, fsdp_layout(params, 2), engine)


def test_unknown_trainer_name_and_unread_parameter_are_named() -> None:
    params = _model()
    trainer = fsdp_layout(params, 2)
    extra = ParamSpec("model.extra.weight", (4, 4))
    trainer.params[extra.name] = extra
    trainer.shards[extra.name] = (Shard(0, ((0, 4), (0, 4))),)
    engine = engine_layout(params, DIMS, tp=1)
    with pytest.raises(LayoutError, match="model.extra.weight"):
        build_plan(params, trainer, engine)
    with_extra = dict(params)
    with_extra[extra.name] = extra
    with pytest.raises(PlanError, match="model.extra.weight"):
        build_plan(with_extra, trainer, engine)
    plan = build_plan(with_extra, trainer, engine, allow_unread=True)
    assert plan.meta["unread_params"] == ["model.extra.weight"]
    assert build_plan(with_extra, trainer, engine, allow_unread={"model.extra.weight"}).plan_hash == plan.plan_hash
    with pytest.raises(PlanError, match="model.extra.weight"):
        build_plan(with_extra, trainer, engine, allow_unread={"lm_head.weight"})


def test_unknown_transform_is_named() -> None:
    params = {"w": ParamSpec("w", (8, 8))}
    trainer = TrainerLayout(1, dict(params), {"w": (Shard(0, ((0, 8), (0, 8))),)})
    engine = EngineLayout(1, {0: {"w": EngineTensor("w", (8, 8), "bfloat16", (Piece(((0, 8), (0, 8)), "w", ((0, 8), (0, 8)), "rot13"),))}})
    with pytest.raises(PlanError, match="rot13"):
        build_plan(params, trainer, engine)


def test_hole_in_overlapping_shards_is_named() -> None:
    params = {"w": ParamSpec("w", (8, 8))}
    # rows 0..6 twice (overlapping boxes) and nothing for rows 6..8 of the right half
    shards = (Shard(0, ((0, 6), (0, 8))), Shard(1, ((2, 8), (0, 4))), Shard(1, ((4, 6), (0, 8)), 24))
    trainer = TrainerLayout(2, dict(params), {"w": shards})
    engine = EngineLayout(1, {0: {"w": EngineTensor("w", (8, 8), "bfloat16", (Piece(((0, 8), (0, 8)), "w", ((0, 8), (0, 8))),))}})
    with pytest.raises(LayoutError, match="'w'"):
        build_plan(params, trainer, engine)


def test_overlapping_shards_still_write_once() -> None:
    params = {"w": ParamSpec("w", (8, 8))}
    shards = (Shard(0, ((0, 6), (0, 8))), Shard(1, ((4, 8), (0, 8))))
    trainer = TrainerLayout(2, dict(params), {"w": shards})
    engine = EngineLayout(1, {0: {"w": EngineTensor("w", (8, 8), "bfloat16", (Piece(((0, 8), (0, 8)), "w", ((0, 8), (0, 8))),))}})
    plan = build_plan(params, trainer, engine)
    assert sum(box_numel(t.dst_box) for t in plan.transfers) == 64


def test_fp8_scale_region_mismatch_is_named() -> None:
    params = {"w": ParamSpec("w", (256, 256))}
    trainer = TrainerLayout(1, dict(params), {"w": (Shard(0, ((0, 256), (0, 256))),)})
    full = ((0, 256), (0, 256))
    engine = EngineLayout(1, {0: {
        "w": EngineTensor("w", (256, 256), "float8_e4m3fn", (Piece(full, "w", full, "fp8_block"),)),
        "w_scale": EngineTensor("w_scale", (2, 1), "float32", (Piece(((0, 2), (0, 1)), "w", full, "fp8_scale"),)),
    }})
    with pytest.raises(LayoutError, match="w_scale"):
        build_plan(params, trainer, engine)


def test_errors_are_fastsync_errors() -> None:
    with pytest.raises(FastSyncError):
        build_plan({}, TrainerLayout(1, {}, {}), EngineLayout(1, {}), max_transfer_bytes=0)


def test_tiny_parts_over_many_shards_are_coalesced_through_an_owner() -> None:
    params = _model()
    trainer = fsdp_layout(params, 16)  # a 256-element norm in 16 parts of 32 bytes
    engine = engine_layout(params, DIMS, tp=2)
    plan = build_plan(params, trainer, engine)
    norm = "model.norm.weight"
    assert norm in plan.gathers
    sends = [t for t in plan.transfers if t.src_param == norm]
    assert len(sends) == 2 and all(t.gathered and t.src_rank == plan.gathers[norm] for t in sends)
    sliced = build_plan(params, trainer, engine, min_transfer_bytes=0)
    assert norm not in sliced.gathers
    assert sum(t.src_param == norm for t in sliced.transfers) == 32


def test_planned_transfers_are_ordinary_transfers() -> None:
    from fastsync.plan.planner import _make_transfer
    from fastsync.plan.types import Transfer

    args = (1, 2, "t", ((0, 1),), "p", ((3, 4),), "copy", 8, False)
    made = _make_transfer(*args)
    assert type(made) is Transfer and made == Transfer(*args) and hash(made) == hash(Transfer(*args))
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.nbytes = 9  # type: ignore[misc]
