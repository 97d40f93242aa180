"""``fastsync reload-bench`` end to end on a tiny model: real vLLM CPU engines, both paths
verified, the JSON keys the issue names; page-cache eviction really evicts."""

from __future__ import annotations

import json
import os

import pytest

from fastsync.bench.reload import evict, resident_fraction
from fastsync.cli import main


def test_evict_drops_pages_and_residency_is_measured(tmp_path):
    p = tmp_path / "blob.bin"
    p.write_bytes(os.urandom(4 << 20))
    with open(p, "rb") as f:
        f.read()
    assert resident_fraction([str(p)]) > 0.9
    evict([str(p)])
    assert resident_fraction([str(p)]) < 0.1


def test_reload_bench_refuses_unknown_model(capsys):
    assert main(["reload-bench", "--model", "no-such-preset"]) == 2
    assert "no-such-preset" in capsys.readouterr().err


@pytest.mark.slow
def test_reload_bench_json_tiny(tmp_path, capsys):
    pytest.importorskip("vllm")
    pytest.importorskip("nixl")
    rc = main(["reload-bench", "--model", "qwen3-tiny", "--repeats", "1", "--workdir", str(tmp_path), "--json"])
    text = capsys.readouterr().out
    out = json.loads(text[text.index("{\n"):])  # a library that logged to stdout before the CLI redirected it
    assert rc == 0 and out["verified"] is True, out
    detail = out["verified_detail"]  # every timed run counted, none left out
    assert detail["peer_runs_verified"] == "1/1" and detail["checkpoint_runs_verified"] == "2/2", detail
    for k in ("weights_seconds", "ready_seconds"):
        assert out[k]["peer"] > 0 and out[k]["checkpoint"] > 0
    assert out["speedup_weights"] > 0 and out["speedup_ready"] > 0 and out["registration_seconds"] >= 0
    assert out["page_cache"]["before_cold"][0] < 0.1 <= out["page_cache"]["before_warm"][0]
