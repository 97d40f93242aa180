"""``fastsync bench`` counts every failure: a timed sync made to fail (the test-only fault hook
``FASTSYNC_BENCH_FAIL_SYNC``) stays in the figures as failed, is printed, and the exit code is
non-zero; ``verified`` covers every timed sync, not one extra untimed one."""

from __future__ import annotations

import json

import pytest

from fastsync.bench.faults import FAIL_SYNC_ENV, fail_version, timed_versions
from fastsync.bench.harness import bench_ok, make_schedule
from fastsync.cli import main
from fastsync.errors import ConfigError


def test_timed_versions_and_the_fault_hook_spec() -> None:
    sched = make_schedule(["rank0", "nixl"], steps=3, warmup=1)
    timed = timed_versions(sched, warmup=1)
    assert timed == {"rank0": [3, 5, 7], "nixl": [4, 6, 8]}  # after the warm-ups, before the checksum syncs
    assert fail_version(sched, 1, "nixl:2") == 6
    assert fail_version(sched, 1, "") is None
    for bad in ("nixl", "nixl:0", "nixl:x", "torch:1", "nixl:4"):
        with pytest.raises(ConfigError, match=FAIL_SYNC_ENV):
            fail_version(sched, 1, bad)


def _row(role: str, rank: int, v: int, ok: bool = True, check_ok: bool = True) -> dict:
    r = {"kind": "sync", "role": role, "rank": rank, "version": v, "ok": ok, "start": float(v), "end": v + 0.5,
         "stages": {}}
    if role == "engine":
        r["check_ok"] = check_ok
    if not ok:
        r["error"] = "boom"
    return r


def test_summary_keeps_failed_and_unverified_syncs_in_the_figures() -> None:
    from fastsync.bench.harness import summarize
    from fastsync.bench.model import build_bench_model

    model = build_bench_model(trainers=1, rollouts=1, size_bytes=1 << 20)
    sched = make_schedule(["nixl"], steps=3, warmup=1)  # v1 warm-up, v2-v4 timed, v5 checksum
    rows = [_row(role, 0, v) for v in (1, 2, 4, 5) for role in ("trainer", "engine")]
    rows += [_row("trainer", 0, 3), _row("engine", 0, 3, ok=False)]
    r = summarize(rows, sched, 1, model, num_procs=2)["nixl"]
    assert r["failed_syncs"] == 1 and r["timed_syncs"] == 3 and r["seconds_all"] == [0.5, None, 0.5]
    assert r["verified_syncs"] == "2/3" and r["checksum_verified"] is True and r["verified"] is False
    assert any(e.startswith("v3 engine 0") for e in r["errors"])
    assert not bench_ok({"error": None, "transports": {"nixl": r}})

    # all timed syncs succeed, one holds wrong bytes after the clock: not verified either
    rows = [_row(role, 0, v) for v in range(1, 6) for role in ("trainer", "engine") if (role, v) != ("engine", 4)]
    rows.append(_row("engine", 0, 4, check_ok=False))
    r = summarize(rows, sched, 1, model, num_procs=2)["nixl"]
    assert r["failed_syncs"] == 0 and r["verified_syncs"] == "2/3" and r["verified"] is False
    rows[-1]["check_ok"] = True
    r = summarize(rows, sched, 1, model, num_procs=2)["nixl"]
    assert r["verified_syncs"] == "3/3" and r["verified"] is True
    assert bench_ok({"error": None, "transports": {"nixl": r}})


@pytest.mark.slow
def test_one_failed_timed_sync_fails_the_bench(capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(FAIL_SYNC_ENV, "nixl:2")
    rc = main(["bench", "--trainers", "2", "--rollouts", "1", "--size-gb", "0.002", "--transport", "nixl",
               "--steps", "3", "--json", "--progress", "off", "--timeout", "60"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 1, out
    r = out["transports"]["nixl"]
    assert r["timed_syncs"] == 3 and r["failed_syncs"] == 1, r
    assert r["seconds_all"][1] is None and None not in (r["seconds_all"][0], r["seconds_all"][2]), r
    assert r["verified_syncs"] == "2/3" and r["verified"] is False, r
    assert any(FAIL_SYNC_ENV in e for e in r["errors"]), r["errors"]
    assert out["fault_injected"]["version"] == 3  # warm-up v1, timed v2, v3 (the 2nd), v4


@pytest.mark.slow
def test_every_timed_sync_is_verified_after_the_clock(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "--trainers", "2", "--rollouts", "2", "--size-gb", "0.002", "--transport", "rank0,nixl",
               "--steps", "2", "--progress", "off", "--timeout", "60"])
    text = capsys.readouterr().out
    assert rc == 0, text
    for name in ("rank0", "nixl"):
        line = next(x for x in text.splitlines() if x.startswith(name))
        assert " 0/2 " in line and " 2/2 " in line, line  # failed 0/2, verified 2/2


@pytest.mark.slow
def test_verify_full_refuses_a_corrupted_sync_naming_tensor_and_rank(capsys: pytest.CaptureFixture[str]) -> None:
    """``--verify full --corrupt 1``: engine rank 0 flips one byte after the first timed sync's
    writes landed; the in-protocol check refuses the version (rolled back), the bench shows
    which tensor and rank and exits non-zero; the other timed syncs pass and report their cost."""
    rc = main(["bench", "--trainers", "2", "--rollouts", "2", "--size-gb", "0.002", "--transport", "nixl",
               "--steps", "2", "--verify", "full", "--corrupt", "1", "--json", "--progress", "off", "--timeout", "60"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 1, out
    r = out["transports"]["nixl"]
    assert r["failed_syncs"] == 1 and r["seconds_all"][0] is None and r["seconds_all"][1] is not None, r
    (c,) = r["corrupted"]
    assert c["engine_rank"] == 0
    err = next(e for e in r["errors"] if "failed verification (full)" in e)
    assert f"{c['tensor']!r}" in err and "engine rank 0" in err and "rolled back" in err, err
    assert r["verify_mode"] == "full" and r["verify_seconds_median"] > 0, r


@pytest.mark.slow
def test_verify_sample_reports_its_cost_beside_the_sync(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "--trainers", "2", "--rollouts", "1", "--size-gb", "0.002", "--transport", "nixl",
               "--steps", "2", "--verify", "sample", "--progress", "off", "--timeout", "60"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "verify=sample before every flip:" in text and "of the sync)" in text, text
