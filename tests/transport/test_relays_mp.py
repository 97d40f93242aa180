"""Relays between engine ranks, real processes over real NIXL (UCX, loopback): 2 trainer ranks
into 4 identical tp1 engines fed by a chain (trainers write replica 0 only; each replica forwards to
the next). Every receiver is checked byte for byte against an independent reference; a relay
killed mid-sync fails the version downstream by name and every receiver keeps a complete version."""

from __future__ import annotations

import pytest

from fastsync.bench.harness import Cluster
from fastsync.bench.workers import WorkerConfig
from fastsync.errors import ConfigError
from fastsync.layout.box import box_numel
from fastsync.layout.types import DTYPE_BYTES
from fastsync.plan.replicate import relay_sources
from fastsync.transport import availability

pytestmark = pytest.mark.skipif(not availability("nixl")[0], reason="NIXL is not importable here")


def _cfg(**kw: object) -> WorkerConfig:
    base = dict(trainers=2, rollouts=4, replicas=4, fanout="chain", port=0, size_bytes=3 << 20, timeout_s=90,
                sync_timeout_s=8, mode="inplace", backup=True, check_exact=True, staging_bytes=256 << 10)
    base.update(kw)
    return WorkerConfig(**base)  # type: ignore[arg-type]


def _rows(rows: list[dict], version: int, role: str) -> list[dict]:
    return [r for r in rows if r.get("kind") == "sync" and r["version"] == version and r["role"] == role]


@pytest.mark.slow
def test_chain_relays_each_trainer_shard_leaves_once_and_every_receiver_is_exact() -> None:
    schedule = [("nixl", 1, True), ("nixl", 2, False), ("nixl", 3, True)]
    with Cluster(_cfg()) as cluster:
        plan = cluster.model.plan
        assert plan.has_relays and [relay_sources(plan, r) for r in range(4)] == [[], [0], [1], [2]]
        cluster.start(schedule)
        rows = cluster.collect(lambda rs: sum(r.get("kind") == "exit" for r in rs) == 6, timeout_s=240)
        m = cluster.model
        shard_max = max(sum(box_numel(sh.box) * DTYPE_BYTES[m.params[n].dtype] for n, shs in m.trainer.shards.items()
                            for sh in shs if sh.rank == r) for r in (0, 1))
    for v in (1, 2, 3):
        eng, tr = _rows(rows, v, "engine"), _rows(rows, v, "trainer")
        assert len(eng) == 4 and len(tr) == 2
        assert all(r["ok"] and r["exact"] and r["served_version"] == v for r in eng), eng
        # trainers wrote replica 0 only: egress is their shard, not 4x it
        egress = [sum(r["bytes_per_link"].values()) for r in tr]
        assert all(set(link.split("->")[1] for link in r["bytes_per_link"]) == {"r0"} for r in tr)
        assert max(egress) <= 1.25 * shard_max
        relayed = {link: n for r in eng for link, n in r["bytes_per_link"].items() if link.startswith("r")}
        assert set(relayed) == {"r0->r1", "r1->r2", "r2->r3"} and len(set(relayed.values())) == 1


@pytest.mark.slow
def test_killed_relay_fails_downstream_by_name_and_every_receiver_keeps_a_complete_version() -> None:
    schedule = [("nixl", 1, True), ("nixl", 2, False)]
    with Cluster(_cfg(kill_engine_open_at=(1, 2))) as cluster:
        cluster.start(schedule)
        rows = cluster.collect(
            lambda rs: sum(r.get("kind") == "sync" and r["role"] == "engine" and r["version"] == 2 for r in rs) == 3,
            timeout_s=240)
        dead = [p for k, p in cluster.procs.items() if k[:2] == ("engine", 1)]
        dead[0].join(10)
        assert dead[0].exitcode == 17  # the relay died with version 2 open
    assert all(r["ok"] for r in _rows(rows, 1, "engine")) and len(_rows(rows, 1, "engine")) == 4
    by_rank = {r["rank"]: r for r in _rows(rows, 2, "engine")}
    assert set(by_rank) == {0, 2, 3}
    for rank in (2, 3):  # downstream of the dead relay: version 2 refused, version 1 kept byte for byte
        r = by_rank[rank]
        assert not r["ok"] and f"engine rank {rank - 1} (relay)" in r["error"], r
        assert r["served_version"] == 1 and r["exact"], r
    # replica 0 got everything from the trainers: it serves 2, or (its forward failed) keeps 1, never torn
    r0 = by_rank[0]
    assert r0["exact"] and r0["served_version"] == (2 if r0["ok"] else 1), r0


def test_transports_without_relays_refuse_a_relay_plan_before_any_byte_moves() -> None:
    from fastsync.bench.model import build_bench_model
    from fastsync.transport.rank0 import Rank0Transport
    from fastsync.transport.torch_p2p import TorchP2PTransport

    model = build_bench_model(trainers=2, rollouts=4, replicas=4, size_bytes=1 << 20, fanout="chain")
    with pytest.raises(ConfigError, match="transport 'torch' cannot relay"):
        TorchP2PTransport()._check_plan(model.plan, "engine rank 2")
    direct = build_bench_model(trainers=2, rollouts=4, replicas=4, size_bytes=1 << 20, fanout="direct")
    TorchP2PTransport()._check_plan(direct.plan, "engine rank 2")  # replicas written directly: fine
    with pytest.raises(ConfigError, match="transport 'rank0' cannot run a plan whose replicas are planned once"):
        Rank0Transport()._check_plan(direct.plan, "trainer rank 0")
