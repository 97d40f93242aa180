"""``fastsync moe-bench`` end to end on a tiny preset (speed is a benchmark's business, not a
test's: this checks the report's shape, that every variant runs the same rounds and steps, that
errors against HF eager are small and a forced mismatch fails the command, and that EP=2 halves
the expert parameters per rank)."""

from __future__ import annotations

import json

import pytest

from fastsync.bench.moe import REL_TOL, VARIANTS
from fastsync.cli import main


def _variants(report: dict) -> dict[str, dict]:
    return {**report["baselines"], "fastsync": report["fastsync"]}


@pytest.mark.slow
def test_moe_bench_json_ep2_same_rounds_for_every_variant(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["moe-bench", "--model", "tiny-qwen2-moe", "--tokens", "32", "--reps", "2", "--rounds", "2",
               "--ep", "2", "--json", "--timeout", "120"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is True and report["mismatches"] == []
    rows = _variants(report)
    assert set(rows) == set(VARIANTS)
    for name, entry in rows.items():
        assert entry["rounds"] == 2, name  # HF eager too: no variant gets a best-of that others do not
        assert entry["timed_steps"] == 4, name
        assert len(entry["tokens_per_s_each_round"]) == 2 and len(entry["peak_mem_bytes_each_round"]) == 2
        assert entry["step_s_min"] <= entry["step_s"] <= entry["step_s_max"]
        assert entry["tokens_per_s"] == pytest.approx(32 / entry["step_s"])
        assert entry["peak_mem_bytes"] >= 0
        assert entry["max_rel_err"] < REL_TOL["float32"] and entry["rel_tol"] == REL_TOL["float32"]
    assert report["baselines"]["hf_eager"]["max_abs_err"] == 0.0  # the reference, and deterministic over rounds
    full = report["baselines"]["hf_eager"]["expert_param_bytes_per_rank"]
    assert report["fastsync"]["expert_param_bytes_per_rank"] * 2 == full
    assert report["fastsync"]["ep"] == 2
    # memory is put beside stock Transformers v5 and the GPU goal, with what a CPU figure means
    assert report["peak_mem_stock"] == "hf_grouped_mm" and "30%" in report["peak_mem_goal"]
    assert "GPU" in report["peak_mem_note"] and report["peak_mem_device"] == "cpu"


@pytest.mark.slow
def test_moe_bench_mismatch_exits_nonzero_naming_variant(capsys: pytest.CaptureFixture[str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The test-only hook puts a relative error of 1e-2 (100x the fp32 tolerance) into fastsync's
    output and 0.5 into HF grouped_mm's: one real run, with --json, then the text report of that
    same run (``run_bench`` handing back its report: no second bench)."""
    import fastsync.bench.moe as moe

    argv = ["moe-bench", "--model", "tiny-qwen3-moe", "--tokens", "16", "--reps", "1", "--rounds", "1",
            "--threads", "1", "--timeout", "120", "--test-perturb", "fastsync=1e-2", "--test-perturb", "hf_grouped_mm=0.5"]
    rc = main([*argv, "--json"])
    captured = capsys.readouterr()
    assert rc == 1
    report = json.loads(captured.out)
    assert report["ok"] is False
    got = {m["variant"]: m for m in report["mismatches"]}
    assert sorted(got) == ["fastsync", "hf_grouped_mm"]  # HF eager is the reference: never perturbed
    for name, err in (("fastsync", 1e-2), ("hf_grouped_mm", 0.5)):
        m = got[name]
        assert m["worst_tensor"] == "out" and m["rel_tol"] == REL_TOL["float32"], m
        assert m["max_rel_err"] == pytest.approx(err, rel=1e-3), m
    assert "MISMATCH fastsync: max rel err 0.01 in out, 100x the tolerance" in captured.err
    assert "MISMATCH hf_grouped_mm: max rel err 0.5 in out, 5e+03x the tolerance" in captured.err
    assert "tolerance 0.0001 for float32" in captured.err
    assert "MISMATCH hf_eager" not in captured.err

    monkeypatch.setattr(moe, "run_bench", lambda *a, **k: report)
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert "MISMATCH fastsync: max rel err 0.01 in out, 100x the tolerance" in captured.err
    assert "numerics: 2 variant(s) over max rel err 0.0001 (float32)" in captured.out and "exit 1" in captured.out


def test_cli_states_the_bench_tolerances() -> None:
    from fastsync.cli.moe_cmd import DTYPE_TOL

    assert DTYPE_TOL == REL_TOL


def test_moe_bench_bad_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["moe-bench", "--model", "no-such-preset"]) == 2
    assert "not a preset" in capsys.readouterr().err


def test_moe_bench_tokens_must_split_over_ep(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["moe-bench", "--model", "tiny-qwen3-moe", "--tokens", "33", "--ep", "2"]) == 2
    assert "divisible by --ep 2" in capsys.readouterr().err
