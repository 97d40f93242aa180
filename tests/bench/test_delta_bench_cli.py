"""`fastsync delta-bench` end to end: a real AdamW step on the scaled Qwen3, real NIXL processes;
the JSON report has the documented keys, every sync is verified against the trainer's weights,
and at lr 1e-6 the delta moves a small fraction of the dense bytes (bytes are deterministic
for the seed; seconds are reported, not asserted)."""

from __future__ import annotations

import json

import pytest

from fastsync.cli import main

pytestmark = pytest.mark.slow


def test_delta_bench_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["delta-bench", "--model", "qwen3-0.6b", "--steps", "1", "--lr", "1e-6", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    (step,) = r["steps"]
    assert {"changed_fraction", "bytes_dense", "bytes_delta", "seconds_dense", "seconds_delta", "verified"} <= set(step)
    assert {"bytes_ratio", "seconds_ratio", "verified"} <= set(r["summary"])
    assert step["verified"] and r["summary"]["verified"]
    assert 0 < step["changed_fraction"] < 0.2
    assert 0 < step["bytes_delta"] < 0.1 * step["bytes_dense"]
    assert step["seconds_dense"] > 0 and step["seconds_delta"] > 0


def test_delta_bench_refuses_bad_arguments_before_spawning(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["delta-bench", "--model", "qwen3-0.6b", "--steps", "0"]) == 2
    assert "--steps" in capsys.readouterr().err
    assert main(["delta-bench", "--model", "/nonexistent/dir", "--steps", "1"]) == 2
