"""The link-level simulator: figures follow from the stated model on hand-computable plans."""

from __future__ import annotations

import pytest

from fastsync.errors import ConfigError
from fastsync.layout.types import ParamSpec
from fastsync.plan.planner import build_plan
from fastsync.plan.simulate import gbps_to_bytes_per_s, rank0_baseline, simulate
from fastsync.bench.synthetic import ModelDims, engine_layout, fsdp_layout, small_model
from fastsync.plan.types import Plan, Transfer

DIMS = ModelDims(layers=2, hidden=256, q_dim=256, kv_dim=128, inter=256, experts=4, moe_inter=128, vocab=128)


def _plan(transfers: list[Transfer], n_tr: int, n_rx: int, **kw: object) -> Plan:
    return Plan(transfers, {}, "t", "e", n_tr, n_rx, dict(kw))


def test_lower_bound_is_busiest_port_over_line_rate() -> None:
    box = ((0, 1),)
    ts = [Transfer(0, 0, "x", box, "p", box, "copy", 3_000_000), Transfer(1, 0, "x", box, "p", box, "copy", 1_000_000),
          Transfer(1, 1, "y", box, "p", box, "copy", 500_000)]
    res = simulate(_plan(ts, 2, 2), nic_gbps=8)  # 1e9 B/s
    assert res.lower_bound_seconds == pytest.approx(4_000_000 / 1e9)  # receiver 0 gets 4 MB
    assert res.max_send_bytes == 3_000_000 and res.max_recv_bytes == 4_000_000
    assert res.bottleneck == "engine rank 0 NIC in"
    expected = 4_000_000 / (1e9 * 0.95) + 2e-6 + 50e-6  # bandwidth-bound, plus first write and fence
    assert res.predicted_seconds == pytest.approx(expected)
    assert res.send_balance == pytest.approx(3_000_000 / 2_250_000)


def test_many_tiny_transfers_are_posting_bound() -> None:
    box = ((0, 1),)
    ts = [Transfer(0, 0, "x", box, "p", box, "copy", 100) for _ in range(1000)]
    res = simulate(_plan(ts, 1, 1), nic_gbps=8, per_transfer_s=1e-6)
    assert res.bottleneck == "posting on trainer rank 0"
    assert res.predicted_seconds == pytest.approx(1000 * 1e-6 + 1e-6 + 50e-6)
    assert res.posting_seconds == pytest.approx(1e-3)


def test_gathers_cost_intra_node_or_nic_time() -> None:
    box = ((0, 1),)
    ts = [Transfer(0, 0, "x", box, "p", box, "fp8_block", 1_000_000, True)]
    plan = Plan(ts, {"p": 0}, "t", "e", 16, 1, {"gather_sources": {"p": [[1, 4_000_000], [9, 4_000_000]]}})
    fast = simulate(plan, nic_gbps=8, intra_node_gbps=800, gpus_per_node=8)
    # rank 9 is on another node: its 4 MB come through rank 0's NIC, then rank 0 sends 1 MB
    assert fast.gather_seconds == pytest.approx(4_000_000 / (1e9 * 0.95) + 1_000_000 / (1e9 * 0.95))
    assert fast.bottleneck == "owner gather then send"
    slow = simulate(plan, nic_gbps=8, gpus_per_node=8)  # intra-node at NIC speed
    assert slow.predicted_seconds >= fast.predicted_seconds


def test_rank0_baseline_is_model_through_rank0_nic_twice() -> None:
    params = {"w": ParamSpec("w", (1000, 1000))}  # 2 MB bf16
    r = rank0_baseline(params, 4, nic_gbps=8, num_trainers=8, gpus_per_node=8, intra_node_gbps=8, efficiency=1.0,
                       hop_latency_s=0.0)
    assert r.model_bytes == 2_000_000 and r.num_buckets == 1
    assert r.gather_seconds == pytest.approx(2_000_000 * 7 / 8 / 1e9)
    assert r.broadcast_seconds == pytest.approx(2_000_000 / 1e9)
    # one bucket: nothing to overlap, gather then broadcast
    assert r.predicted_seconds == pytest.approx(r.gather_seconds + r.broadcast_seconds)
    many = rank0_baseline(params, 4, nic_gbps=8, num_trainers=8, intra_node_gbps=8, efficiency=1.0,
                          hop_latency_s=0.0, bucket_bytes=200_000)
    assert many.num_buckets == 10
    assert many.predicted_seconds == pytest.approx(many.broadcast_seconds + many.gather_seconds / 10)
    serial = rank0_baseline(params, 4, nic_gbps=8, num_trainers=8, intra_node_gbps=8, efficiency=1.0,
                            hop_latency_s=0.0, bucket_bytes=200_000, overlap=False)
    assert serial.predicted_seconds == pytest.approx(many.gather_seconds + many.broadcast_seconds)
    two = rank0_baseline(params, 4, nic_gbps=8, num_trainers=8, num_groups=2, efficiency=1.0, hop_latency_s=0.0)
    assert two.broadcast_seconds == pytest.approx(2 * r.broadcast_seconds)


def test_planned_sync_beats_rank0_on_a_real_plan() -> None:
    dims = ModelDims(layers=4, hidden=2048, q_dim=2048, kv_dim=512, experts=8, moe_inter=1024, vocab=8192)
    params = small_model(dims)  # ~0.3 B parameters: bandwidth, not posting latency, dominates
    plan = build_plan(params, fsdp_layout(params, 8), engine_layout(params, dims, tp=2, replicas=2, fp8=True))
    res = simulate(plan, nic_gbps=400, intra_node_gbps=3600)
    base = rank0_baseline(params, plan.num_receivers, nic_gbps=400, num_trainers=8)
    assert res.lower_bound_seconds <= res.predicted_seconds < base.predicted_seconds
    assert res.lower_bound_seconds == pytest.approx(max(plan.recv_bytes() + plan.send_bytes()) / gbps_to_bytes_per_s(400))


def test_bad_bandwidth_is_refused() -> None:
    plan = _plan([], 1, 1)
    with pytest.raises(ConfigError, match="nic_gbps"):
        simulate(plan, nic_gbps=0)
    with pytest.raises(ConfigError, match="intra_node_gbps"):
        simulate(plan, nic_gbps=1, intra_node_gbps=-1)
