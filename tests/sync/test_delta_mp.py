"""Delta sync between real processes over NIXL (127.0.0.1): trainer ranks with fp32 shards,
engine ranks with bf16 / block-FP8 tensors of awkward sizes (hidden 200, vocab 262, chunks of
4099 elements), every engine rank compared bit for bit with an independent reference after
every version, verified by CRCs of the whole destination."""

from __future__ import annotations

import pytest

from fastsync_rigs.delta_jobs import DeltaJob, job_model, run_job

pytestmark = pytest.mark.slow


def _rows(rows: list[dict], role: str, version: int) -> list[dict]:
    return [r for r in rows if r.get("kind") == "sync" and r["role"] == role and r["version"] == version]


def test_twenty_mixed_dense_and_delta_syncs_bit_exact_and_missed_version_resynced_densely() -> None:
    modes = {1: "dense", 7: "dense", 13: "dense"}
    schedule = [(v, modes.get(v, "delta")) for v in range(1, 21)]
    # engine rank 1 rolls back version 9 before writing; engine rank 0's post-processing fails after
    # the delta of version 14 was written: it must restore exactly what that delta overwrote
    job = DeltaJob(trainers=2, rollouts=2, port=0, schedule=schedule, abort_at={1: 9}, fail_apply_at={0: 14})
    rows = run_job(job)
    for v, mode in schedule:
        engines = _rows(rows, "engine", v)
        assert len(engines) == 2, v
        for r in engines:
            assert r["exact"], (v, r)
            if (r["rank"], v) == (1, 9):
                assert not r["ok"] and r["served_version"] == 8
            elif (r["rank"], v) == (0, 14):
                assert not r["ok"] and r["served_version"] == 13 and "post-processing fails" in r["error"]
            else:
                assert r["ok"] and r["served_version"] == v, r
        assert all(r["ok"] for r in _rows(rows, "trainer", v)), _rows(rows, "trainer", v)
    # delta versions with unchanged-heavy updates move far fewer bytes than the dense size
    deltas = [r for r in rows if r.get("kind") == "sync" and r["role"] == "trainer" and r.get("mode") == "delta"]
    sparse = [r for r in deltas if r["version"] % 4 == 1 and not r["dense_links"]]
    assert sparse and all(r["bytes_sent"] < 0.05 * r["bytes_dense"] for r in sparse), sparse
    unchanged = [r for r in deltas if r["version"] % 4 == 0]
    assert unchanged and all(r["changed"] == 0 for r in unchanged)
    # version 10: engine rank 1 missed 9 (rolled back), so its link is sent dense, rank 0's as a delta
    t10 = _rows(rows, "trainer", 10)
    assert all(r["dense_links"] == [1] for r in t10), t10
    e10 = {r["rank"]: r for r in _rows(rows, "engine", 10)}
    assert e10[1]["changed"] == e10[1]["elements"] and e10[0]["changed"] < e10[0]["elements"]
    # version 15: engine rank 0 restored 13 after 14's failed post-processing: its link goes dense
    assert all(r["dense_links"] == [0] for r in _rows(rows, "trainer", 15)), _rows(rows, "trainer", 15)


def test_fp8_engine_block_deltas_bit_exact() -> None:
    schedule = [(1, "dense"), (2, "delta"), (3, "delta"), (4, "delta"), (5, "delta"), (6, "dense"), (7, "delta")]
    rows = run_job(DeltaJob(trainers=1, rollouts=2, port=0, schedule=schedule, fp8=True))
    for v, _ in schedule:
        engines = _rows(rows, "engine", v)
        assert len(engines) == 2 and all(r["ok"] and r["exact"] and r["served_version"] == v for r in engines), engines


def test_killed_trainer_mid_delta_leaves_every_engine_on_its_last_version() -> None:
    schedule = [(1, "dense"), (2, "delta"), (3, "delta")]  # version 3 changes 40%: a multi-page stream
    job = DeltaJob(trainers=2, rollouts=2, port=0, schedule=schedule, kill_at=(1, 3, 1), sync_timeout_s=5.0,
                   page_bytes=4096)
    rows = run_job(job)
    engines = _rows(rows, "engine", 3)
    assert len(engines) == 2
    for r in engines:
        assert not r["ok"] and r["served_version"] == 2 and r["exact"], r
        assert "trainer rank 1" in r["error"], r["error"]
    assert all(r["ok"] and r["exact"] for r in _rows(rows, "engine", 2))


def test_deltas_relayed_down_a_chain_of_four_replicas_bit_exact() -> None:
    """Relays forward the delta streams themselves: the trainer ranks write only the chain's root
    replica (bytes counted per link), every replica down the chain applies the root's streams and
    ends bit-exact; a replica that rolled back a version gets its chain's links dense next time."""
    schedule = [(1, "dense"), (2, "delta"), (3, "delta"), (4, "delta"), (5, "delta"), (6, "delta")]
    job = DeltaJob(trainers=2, rollouts=4, replicas=4, fanout="chain", port=0, schedule=schedule, abort_at={3: 3})
    rows = run_job(job)
    for v, _ in schedule:
        engines = {r["rank"]: r for r in _rows(rows, "engine", v)}
        assert sorted(engines) == [0, 1, 2, 3], v
        for rank, r in engines.items():
            assert r["exact"], (v, r)
            if (rank, v) == (3, 3):
                assert not r["ok"] and r["served_version"] == 2
            else:
                assert r["ok"] and r["served_version"] == v, (v, r)
        trainers = _rows(rows, "trainer", v)
        assert all(r["ok"] for r in trainers), trainers
        if v > 1:
            assert all(r["mode"] == "delta" for r in trainers), trainers
    # a sparse step (0.3% of the elements) moves a small fraction of the dense bytes, and
    # bytes_dense is one replica's: the trainer ranks wrote the chain's root only
    t5 = _rows(rows, "trainer", 5)
    assert all(r["bytes_sent"] < 0.05 * r["bytes_dense"] for r in t5), t5
    one_replica = sum(r["bytes_dense"] for r in t5)
    assert one_replica == job_model_bytes(job), (one_replica, job_model_bytes(job))
    # version 4: engine rank 3 (down the chain) missed version 3, so the chain's links went dense,
    # and every replica applied that dense stream; version 5 is a delta again
    assert all(r["dense_links"] == [0] for r in _rows(rows, "trainer", 4)), _rows(rows, "trainer", 4)
    assert all(r["dense_links"] == [] for r in _rows(rows, "trainer", 5)), _rows(rows, "trainer", 5)
    e2 = {r["rank"]: r for r in _rows(rows, "engine", 2)}
    assert all(0 < e2[k]["changed"] < e2[k]["elements"] for k in range(4)), e2


def job_model_bytes(job: DeltaJob) -> int:
    """Bytes of one replica's planned transfers (what trainer ranks write without relays into one)."""
    return sum(t.nbytes for t in job_model(job).plan.transfers)
