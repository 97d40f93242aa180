"""The simulator on hosts that share a NIC (``fastsync.plan.shared_nic``): placement, per-host bytes,
TCP-like fair sharing, gloo's binomial broadcast, and bad input named."""

from __future__ import annotations

import pytest

from fastsync.bench.model import build_bench_model
from fastsync.errors import ConfigError
from fastsync.plan.shared_nic import HostMap, fair_share_seconds, flow_bytes, host_traffic, rank0_on_hosts, simulate_on_hosts


def test_spread_places_blocks_and_refuses_what_does_not_divide() -> None:
    h = HostMap.spread(4, 2, 2, 2)
    assert h.trainer_host == (0, 0, 1, 1) and h.engine_host == (2, 3) and h.num_hosts == 4
    assert h.placement()[("engine", 1)] == 3
    with pytest.raises(ConfigError, match="3 trainer host.*divide the 4 trainer ranks"):
        HostMap.spread(4, 2, 3, 1)
    with pytest.raises(ConfigError, match="engine"):
        HostMap.spread(4, 2, 1, 0)


def test_host_traffic_counts_only_what_crosses_and_every_byte_once() -> None:
    m = build_bench_model(trainers=4, rollouts=2, size_bytes=8 << 20)
    far = host_traffic(m.plan, HostMap.spread(4, 2, 2, 2))
    assert far.cross_host_bytes == m.plan.bytes_total == sum(far.ingress) and sum(far.intra) == 0
    # everyone on one host: nothing touches a NIC
    near = host_traffic(m.plan, HostMap((0, 0, 0, 0), (0, 0)))
    assert near.cross_host_bytes == 0 and sum(near.intra) == m.plan.bytes_total
    sim = simulate_on_hosts(m.plan, HostMap.spread(4, 2, 2, 2), nic_gbps=8.0, efficiency=1.0)
    busiest = max(max(far.egress), max(far.ingress))
    assert sim["nic_seconds"] == pytest.approx(busiest / 1e9)
    assert sim["predicted_seconds"] >= sim["nic_seconds"]


def test_relay_chain_moves_replica_bytes_between_engine_hosts_and_adds_hops() -> None:
    m = build_bench_model(trainers=2, rollouts=4, replicas=4, size_bytes=8 << 20, fanout="chain")
    tr = host_traffic(m.plan, HostMap.spread(2, 4, 1, 4))
    assert tr.relay_hops >= 1 and tr.egress[0] < tr.cross_host_bytes  # the trainer host sends one copy
    chain = simulate_on_hosts(m.plan, HostMap.spread(2, 4, 1, 4), nic_gbps=1.0, relay_unit_bytes=1 << 20)
    assert chain["relay_seconds"] > 0


def test_fair_share_is_the_port_bound_when_balanced_and_longer_when_not() -> None:
    assert fair_share_seconds([(0, 1, 100), (0, 2, 100)], 100.0) == pytest.approx(2.0)
    # host 0 sends 100 and 50; host 3 sends 100 into host 2 as well: 2's ingress is shared
    assert fair_share_seconds([(0, 1, 100), (0, 2, 50), (3, 2, 100)], 100.0) == pytest.approx(1.5)
    m = build_bench_model(trainers=4, rollouts=2, size_bytes=8 << 20)
    assert set(flow_bytes(m.plan, HostMap.spread(4, 2, 2, 2))) == {(t, e) for t in range(4) for e in range(2)}


def test_rank0_follows_gloos_binomial_tree() -> None:
    h = HostMap((0,), (1, 2, 3))  # group: trainer 0, then engines 0..2 (4 ranks: 2 tree steps)
    one = rank0_on_hosts([1000], [{0: 1000}], h, nic_gbps=8e-6, efficiency=1.0)  # 1000 bytes/s
    # step 0: rank 0 -> engine 0 (1 s); step 1: rank 0 -> engine 1 and engine 0 -> engine 2, parallel
    assert one["tree_steps"] == 2 and one["broadcast_seconds"] == pytest.approx(2.0)
    assert one["cross_host_bytes"] == 3000
    # a trainer rank on another host sends its shard to rank 0 first
    two = rank0_on_hosts([1000], [{0: 500, 1: 500}], HostMap((0, 4), (1, 2, 3)), nic_gbps=8e-6, efficiency=1.0)
    assert two["gather_seconds"] == pytest.approx(0.5) and two["cross_host_bytes"] == 3500
    with pytest.raises(ConfigError, match="efficiency"):
        rank0_on_hosts([1], [{0: 1}], h, nic_gbps=1.0, efficiency=1.5)
