"""Identical replicas planned once, fanned out directly or through relays; physical bound; the
baseline ratio. Real presets through ``fastsync plan`` for the issue-13 figures (model arithmetic,
not timings: planning time is measured by the CLI, not asserted here)."""

from __future__ import annotations

import json

import pytest

from fastsync.cli import main
from fastsync.cli.plan_cmd import baseline_ratio
from fastsync.errors import PlanError
from fastsync.plan.planner import build_plan
from fastsync.plan.replicate import expand, expand_indexed, receiver_copies, relay_sources, replica_structure, sender_copies
from fastsync.plan.types import Plan
from fastsync.plan.simulate import gbps_to_bytes_per_s, simulate
from fastsync.bench.synthetic import ModelDims, engine_layout, fsdp_layout, small_model

DIMS = ModelDims(layers=2, experts=4, hidden=160, q_dim=96, kv_dim=48, moe_inter=72, vocab=136)


def _setup(replicas: int, trainers: int = 3, tp: int = 2):  # type: ignore[no-untyped-def]
    params = small_model(DIMS)
    return params, fsdp_layout(params, trainers), engine_layout(params, DIMS, tp=tp, replicas=replicas)


def test_replicas_found_and_planned_once() -> None:
    params, trainer, engine = _setup(5)
    assert replica_structure(engine) == (2, 5)
    assert replica_structure(_setup(1)[2]) is None
    one = build_plan(params, trainer, _setup(1)[2])
    many = build_plan(params, trainer, engine, fanout="direct")
    # the per-replica plan is replica 0's, whatever the replica count; copies are counted by the views
    assert len(many.transfers) == len(one.transfers)
    assert many.num_receivers == 10 and many.fanout is not None and not many.has_relays
    assert many.send_bytes() == [5 * b for b in one.send_bytes()]
    assert many.recv_bytes() == one.recv_bytes() * 5
    flat = build_plan(params, trainer, engine)  # fanout="off": every rank planned, as before
    assert sorted(map(repr, expand(many)[0])) == sorted(map(repr, flat.transfers))


def test_chain_sends_each_byte_from_its_trainer_once_and_relays_the_rest() -> None:
    params, trainer, engine = _setup(4)
    one = build_plan(params, trainer, _setup(1)[2])
    plan = build_plan(params, trainer, engine, fanout="chain")
    assert plan.fanout.parents == (-1, 0, 1, 2) and plan.has_relays
    assert plan.send_bytes() == one.send_bytes()
    direct, relays = expand(plan)
    assert {t.dst_rank for t in direct} == {0, 1}
    assert {(r.src_rank, r.dst_rank) for r in relays} == {(0, 2), (1, 3), (2, 4), (3, 5), (4, 6), (5, 7)}
    assert max(r.hop for r in relays) == 3 and relay_sources(plan, 7) == [5] and relay_sources(plan, 1) == []
    sim = simulate(plan, nic_gbps=400)
    assert sim.relay_hops == 3 and sim.relayed_bytes == 3 * sum(one.recv_bytes())
    biggest = max(t.nbytes for t in plan.transfers)
    assert sim.relay_seconds == pytest.approx(3 * (biggest / (gbps_to_bytes_per_s(400) * 0.95) + 2e-6))


@pytest.mark.parametrize("mode", ["direct", "auto", "chain"])
def test_per_rank_copies_are_the_expanded_plans(mode: str) -> None:
    """Programs are compiled from per-rank copies (cost of one replica, not all): they must be exactly
    the expanded plan's writes, with the same flat indices."""
    params, trainer, engine = _setup(5)
    plan = build_plan(params, trainer, engine, fanout=mode)
    direct = expand_indexed(plan)[0]
    for r in range(plan.num_trainers):
        assert sorted(map(repr, sender_copies(plan, r))) == sorted(repr(x) for x in direct if x[1].src_rank == r)
    for r in range(plan.num_receivers):
        assert sorted(map(repr, receiver_copies(plan, r))) == sorted(repr(x) for x in direct if x[1].dst_rank == r)


def test_ranks_feeding_several_replicas_take_them_in_turns_from_different_starts() -> None:
    """Each trainer rank alternates between the replicas it feeds, transfer by transfer, starting at
    a replica set by its rank: never all of one replica before the next (every rank then wrote into
    one replica's NIC at a time; two peer holders feeding two chain roots ran at half line rate)."""
    params, trainer, engine = _setup(4, trainers=2)
    plan = build_plan(params, trainer, engine, fanout="direct")
    e, n = plan.fanout.replica_size, len(plan.transfers)
    for r in range(plan.num_trainers):
        replicas = [idx // n for idx, _ in sender_copies(plan, r)]
        assert all(t.dst_rank // e == k for (_, t), k in zip(sender_copies(plan, r), replicas))
        assert replicas[:4] == [(r + j) % 4 for j in range(4)], replicas[:8]
        # in every window of four consecutive writes each replica once
        assert all(sorted(replicas[j:j + 4]) == [0, 1, 2, 3] for j in range(0, len(replicas), 4)), replicas
    firsts = {sender_copies(plan, r)[0][0] // n for r in range(plan.num_trainers)}
    assert firsts == {0, 1}  # the two ranks start at different replicas


def test_fanout_is_part_of_the_plan_identity() -> None:
    params, trainer, engine = _setup(3)
    hashes = {build_plan(params, trainer, engine, fanout=m).plan_hash for m in ("off", "direct", "chain")}
    assert len(hashes) == 3
    other = build_plan(params, trainer, _setup(4)[2], fanout="chain")
    assert other.engine_hash != build_plan(params, trainer, engine, fanout="chain").engine_hash
    with pytest.raises(PlanError, match="fanout"):
        build_plan(params, trainer, engine, fanout="tree")
    text = build_plan(params, trainer, engine, fanout="chain").dumps()
    with pytest.raises(PlanError, match="replica 1 has parent 2"):  # a cycle would relay forever
        Plan.loads(text.replace('"fanout":[2,3,[-1,0,1]', '"fanout":[2,3,[-1,2,1]'))


def test_physical_bound_counts_unique_owner_bytes_and_receivers() -> None:
    params, trainer, engine = _setup(2, trainers=2)
    plan = build_plan(params, trainer, engine, fanout="auto")
    owner = plan.meta["owner_unique_bytes"]
    # FSDP over 2 ranks without replication: every byte has one holder, bf16 out of a bf16 model
    assert sum(owner) == sum(p.nbytes for p in params.values())
    sim = simulate(plan, nic_gbps=8)  # 1 GB/s line rate
    assert sim.physical_bound_seconds == pytest.approx(max(max(owner), max(plan.recv_bytes())) / 1e9)
    assert sim.physical_bound_seconds <= sim.lower_bound_seconds <= sim.predicted_seconds


def test_baseline_ratio_both_ways() -> None:
    assert baseline_ratio(3.0, 1.0) == "3.0x slower than fastsync"
    assert baseline_ratio(1.3, 3.86) == "3.0x faster than fastsync"  # the case: never "0x slower"


def _plan_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_qwen3_30b_into_192_tp1_replicas_near_the_physical_bound(capsys: pytest.CaptureFixture[str]) -> None:
    r = _plan_json(capsys, "--model", "qwen3-30b-a3b", "--trainer", "fsdp:64", "--rollout", "vllm:tp1,replicas192",
                   "--nic-gbps", "400")
    assert r["physical_bound_seconds"] == pytest.approx(61.06e9 / 50e9, rel=1e-3)
    assert r["predicted_seconds"] <= 1.15 * r["physical_bound_seconds"]
    assert r["predicted_seconds"] <= r["rank0_predicted_seconds"]
    assert r["direct_bound_seconds"] > 2.5 * r["physical_bound_seconds"]  # what the direct scheme would cost
    assert r["relayed_bytes"] > 0 and r["replicas"] == 192


def test_mixtral_owner_bound_relayed(capsys: pytest.CaptureFixture[str]) -> None:
    r = _plan_json(capsys, "--model", "mixtral-8x7b", "--trainer", "fsdp:256", "--rollout",
                   "vllm:tp8,dp4,ep,replicas4", "--nic-gbps", "400")
    assert r["physical_bound_seconds"] == pytest.approx(0.234, abs=0.002)
    assert r["predicted_seconds"] <= 0.30 < r["direct_bound_seconds"]
    assert r["trainer_fed_replicas"] == 1
