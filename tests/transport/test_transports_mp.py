"""Each transport between real processes (spawned, 127.0.0.1): uneven FSDP (T=3) onto TP=2 with
block-FP8 engine weights (owner gathers), bit-exact against an independent reference, verified
by checksums; and a trainer killed
mid-sync (NIXL) leaves every receiver on its last complete version, after which a restarted
trainer's sync succeeds."""

from __future__ import annotations

import pytest

from fastsync.bench.harness import Cluster, make_schedule
from fastsync.bench.workers import WorkerConfig

pytestmark = pytest.mark.slow


def _sync_rows(rows: list[dict], version: int) -> list[dict]:
    return [r for r in rows if r.get("kind") == "sync" and r["version"] == version]


def test_all_transports_uneven_trainers_fp8_with_owner_gathers_bit_exact_shadow_mode() -> None:
    """T=3 FSDP shards cut the 128x128 FP8 blocks, so the plan gathers those parameters on owner
    ranks first; the receivers' FP8 weights and scales must equal the reference bit for bit."""
    cfg = WorkerConfig(trainers=3, rollouts=2, port=0, size_bytes=2 << 20, timeout_s=60, mode="shadow",
                       check_exact=True, staging_bytes=256 << 10, fp8=True)
    schedule = make_schedule(["rank0", "torch", "nixl"], steps=1, warmup=0, verify=True)
    with Cluster(cfg) as cluster:
        assert cluster.model.plan.gathers and any(t.transform == "fp8_block" for t in cluster.model.plan.transfers)
        cluster.start(schedule)
        rows = cluster.collect(lambda rs: sum(r.get("kind") == "exit" for r in rs) == 5, timeout_s=240)
    for name, version, verify in schedule:
        got = _sync_rows(rows, version)
        assert len(got) == 5, (name, version)
        assert all(r["ok"] for r in got), [r.get("error") for r in got]
        engines = [r for r in got if r["role"] == "engine"]
        assert all(r["exact"] and r["served_version"] == version for r in engines), (name, version)
        assert all(r.get("verified") == verify for r in engines)
    trainer_links = [r["bytes_per_link"] for r in rows if r.get("kind") == "sync" and r["role"] == "trainer"
                     and r["transport"] == "nixl"]
    assert any(trainer_links)


def test_killed_trainer_mid_sync_keeps_old_version_then_next_sync_succeeds() -> None:
    cfg = WorkerConfig(trainers=2, rollouts=2, port=0, size_bytes=2 << 20, timeout_s=90, sync_timeout_s=6,
                       mode="inplace", backup=True, check_exact=True, staging_bytes=128 << 10, kill_at=(1, 2, 1),
                       watch_peers=False)  # trainer 1 is replaced: the barrier waits for the new process
    schedule = [("nixl", 1, True), ("nixl", 2, False), ("nixl", 3, True)]
    with Cluster(cfg) as cluster:
        cluster.start(schedule)
        rows = cluster.collect(
            lambda rs: sum(r.get("kind") == "sync" and r["role"] == "engine" and r["version"] == 2 for r in rs) == 2,
            timeout_s=120)
        killed = [p for k, p in cluster.procs.items() if k[:2] == ("trainer", 1)]
        killed[0].join(10)
        assert killed[0].exitcode == 17  # died inside the sync, after posting some writes
        from dataclasses import replace

        cluster.spawn("trainer", 1, replace(cluster.cfg, schedule=[("nixl", 3, True)], kill_at=None))
        rows = cluster.collect(lambda rs: sum(r.get("kind") == "exit" for r in rs) == 4, timeout_s=120)
    v1, v2, v3 = (_sync_rows(rows, v) for v in (1, 2, 3))
    assert all(r["ok"] for r in v1) and len(v1) == 4
    engines2 = [r for r in v2 if r["role"] == "engine"]
    assert len(engines2) == 2
    for r in engines2:
        assert not r["ok"] and "trainer rank 1" in r["error"], r
        assert r["served_version"] == 1 and r["exact"], r  # still serving version 1, byte for byte
    assert all(r["ok"] for r in v3) and len(v3) == 4, [r.get("error") for r in v3]
    assert all(r["exact"] and r["served_version"] == 3 for r in v3 if r["role"] == "engine")
