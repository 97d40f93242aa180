"""``fastsync bench`` end to end: real processes, all three transports, bit-exact (T=4, R=2)."""

from __future__ import annotations

import json

import pytest

from fastsync.cli import main


@pytest.mark.slow
def test_bench_json_all_transports_bit_exact(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "--trainers", "4", "--rollouts", "2", "--size-gb", "0.002", "--steps", "1",
               "--check-exact", "--json", "--progress", "off", "--timeout", "60"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0, out
    assert set(out["transports"]) == {"rank0", "torch", "nixl"}
    for name, r in out["transports"].items():
        assert r["verified"] is True, (name, r["errors"])
        assert r["exact"] is True, name  # every receiver equals an independent reference
        assert r["seconds_median"] > 0 and r["gbps"] > 0
        # in-place writes (the default mode): the engine holds no complete version for the whole receive
        assert 0 < r["engine_stall_seconds"] <= r["seconds_median"], (name, r)
    assert out["speedup_vs_rank0"] is not None and out["speedup_vs_rank0"] > 0
    assert out["trainers"] == 4 and out["rollouts"] == 2


def test_bench_refuses_bad_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--trainers", "2", "--rollouts", "1", "--size-gb", "1", "--transport", "carrier-pigeon"]) == 2
    assert "carrier-pigeon" in capsys.readouterr().err
    assert main(["bench", "--trainers", "0", "--rollouts", "1", "--size-gb", "1"]) == 2
    assert main(["bench", "--trainers", "2", "--rollouts", "1"]) == 2


@pytest.mark.slow
def test_readme_relay_command_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """The README's relay command (``--trainers 2 --rollouts 4 --replicas 4 --size-gb 0.5 --transport
    nixl``) used to fail in every worker: the parent planned without ``replicas``/``fanout`` while the
    workers planned with them ("this process planned c87f..., the parent 6185...")."""
    rc = main(["bench", "--trainers", "2", "--rollouts", "4", "--replicas", "4", "--size-gb", "0.5", "--transport",
               "nixl", "--steps", "1", "--json", "--progress", "off"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["error"] is None, out["error"]
    r = out["transports"]["nixl"]
    assert r["verified"] is True and out["fanout"] == "chain" and out["replicas"] == 4
    assert r["relayed_bytes"] > 0 and r["trainer_egress_bytes_max"] <= 1.05 * out["trainer_shard_bytes_max"]


@pytest.mark.slow
def test_bench_shadow_mode_stalls_the_engine_for_the_flip_only(capsys: pytest.CaptureFixture[str]) -> None:
    """With a shadow landing the writes go beside the live tensors: the engine's stall is the
    flip's copy, a part of the sync (measured per sync from the engine ranks' own stages)."""
    rc = main(["bench", "--trainers", "2", "--rollouts", "2", "--size-gb", "0.02", "--steps", "3", "--mode", "shadow",
               "--transport", "nixl", "--json", "--progress", "off", "--timeout", "60"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0, out
    r = out["transports"]["nixl"]
    assert r["verified"] is True
    # the flip's copy (~8 ms of a ~40 ms sync here; in place it is the whole receive, ~3/4 of the
    # sync): a wide margin, since the stall is the slowest engine rank's and the machine is shared
    # (comparing it with the ranks' median apply at rel=0.5 failed under load); the definition
    # itself is checked exactly below
    assert 0 < r["engine_stall_seconds"] < 0.6 * r["seconds_median"], r


def test_engine_stall_is_what_each_landing_keeps_the_engine_from_serving() -> None:
    """``engine_stall_seconds`` per engine row: the whole receive in place, the flip's copy with a
    shadow, a delta's writing in and what follows it (not its arrival)."""
    from fastsync.bench.harness import engine_stall_seconds

    row = {"start": 10.0, "end": 10.5, "stages": {"wait": 0.3, "apply": 0.125, "verify": 0.05, "postprocess": 0.02}}
    assert engine_stall_seconds(row, "inplace") == 0.5
    assert engine_stall_seconds(row, "shadow") == 0.125
    delta = {**row, "payload": {"mode": "delta"}}
    assert engine_stall_seconds(delta, "inplace") == pytest.approx(0.125 + 0.05 + 0.02)
    assert engine_stall_seconds({"start": 1.0, "end": 2.0, "stages": {}}, "shadow") == 0.0
