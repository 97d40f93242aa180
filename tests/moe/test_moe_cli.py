"""``fastsync moe-bench`` end to end on a tiny preset (speed is a benchmark's business, not a
test's: this checks the report's shape, that errors against HF eager are small, and that EP=2
halves the expert parameters per rank)."""

from __future__ import annotations

import json

import pytest

from fastsync.cli import main


def test_moe_bench_json_ep2(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["moe-bench", "--model", "tiny-qwen2-moe", "--tokens", "32", "--reps", "1", "--rounds", "1",
               "--ep", "2", "--json", "--timeout", "120"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["baselines"]) == {"hf_eager", "hf_grouped_mm"}
    for entry in [*report["baselines"].values(), report["fastsync"]]:
        assert entry["tokens_per_s"] > 0
        assert entry["peak_mem_bytes"] >= 0
        assert entry["max_abs_err"] < 1e-5
    assert report["baselines"]["hf_eager"]["max_abs_err"] == 0.0  # the reference itself
    full = report["baselines"]["hf_eager"]["expert_param_bytes_per_rank"]
    assert report["fastsync"]["expert_param_bytes_per_rank"] * 2 == full
    assert report["fastsync"]["ep"] == 2


def test_moe_bench_bad_model(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["moe-bench", "--model", "no-such-preset"]) == 2
    assert "not a preset" in capsys.readouterr().err


def test_moe_bench_tokens_must_split_over_ep(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["moe-bench", "--model", "tiny-qwen3-moe", "--tokens", "33", "--ep", "2"]) == 2
    assert "divisible by --ep 2" in capsys.readouterr().err
