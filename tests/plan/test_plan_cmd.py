"""`fastsync plan` end to end on real presets and a local config directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fastsync.cli import main
from fastsync.plan.types import Plan

KEYS = {"tensors", "bytes_total", "transfers", "plan_seconds", "predicted_seconds", "rank0_predicted_seconds",
        "lower_bound_seconds", "send_balance", "recv_balance", "plan_hash"}


def _run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_report_and_saved_plan(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    r = _run_json(capsys, "--model", "qwen3-30b-a3b", "--trainer", "fsdp:8", "--rollout", "vllm:tp4,replicas2",
                  "--dtype-out", "fp8", "--nic-gbps", "400", "--save", str(out))
    assert KEYS <= set(r)
    assert r["num_trainers"] == 8 and r["num_receivers"] == 8 and r["tensors"] > 100
    assert 0 < r["lower_bound_seconds"] <= r["predicted_seconds"] < r["rank0_predicted_seconds"]
    assert r["send_balance"] >= 1.0 and r["recv_balance"] >= 1.0
    plan = Plan.loads(out.read_text())
    assert plan.plan_hash == r["plan_hash"] and len(plan.transfers) == r["transfers"]
    assert plan.bytes_total == r["bytes_total"]
    # same inputs, same plan; another rollout, another plan
    small = ["--model", "qwen3-0.6b", "--trainer", "fsdp:4", "--dtype-out", "fp8"]
    one = _run_json(capsys, *small, "--rollout", "vllm:tp2,replicas2")
    assert _run_json(capsys, *small, "--rollout", "vllm:tp2,replicas2")["plan_hash"] == one["plan_hash"]
    assert _run_json(capsys, *small, "--rollout", "vllm:tp4")["plan_hash"] != one["plan_hash"]


def test_human_table_from_a_config_directory(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    cfg = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 256, "intermediate_size": 512,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
           "vocab_size": 1024, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert main(["plan", "--model", str(tmp_path), "--trainer", "hsdp:2x2", "--rollout", "vllm:tp2,replicas2"]) == 0
    text = capsys.readouterr().out
    for row in ("tensors", "bytes", "transfers", "send per trainer", "recv per engine rank", "predicted sync",
                "rank-0 baseline", "time to plan", "plan hash"):
        assert row in text


@pytest.mark.parametrize("argv, needle", [
    (["--model", "no-such-model", "--trainer", "fsdp:8", "--rollout", "vllm:tp8"], "no-such-model"),
    (["--model", "qwen3-0.6b", "--trainer", "fsdp:x", "--rollout", "vllm:tp8"], "fsdp:x"),
    (["--model", "qwen3-0.6b", "--trainer", "fsdp:8", "--rollout", "vllm:tp8", "--nic-gbps", "0"], "--nic-gbps"),
    (["--model", "qwen3-0.6b", "--trainer", "fsdp:8", "--rollout", "vllm:tp8", "--nic-gbps", "inf"], "--nic-gbps"),
    (["--model", "qwen3-0.6b", "--trainer", "fsdp:2", "--rollout", "vllm:tp2,quant=bf16", "--dtype-out", "fp8"],
     "--dtype-out) fp8 conflicts with quant=bf16"),
    (["--model", "qwen3-0.6b", "--trainer", "fsdp:2", "--rollout", "vllm:tp2,dtype=int8"], "field 'dtype'"),
    (["--model", "qwen3-0.6b", "--trainer", "fsdp:2,dim=7", "--rollout", "vllm:tp2"], "field 'dim'=7"),
    (["--model", "qwen3-0.6b", "--trainer", "fsdp:2", "--rollout", "vllm:tp2", "--max-transfer-mb", "1e-9"],
     "--max-transfer-mb"),
])
def test_bad_input_is_one_clear_error(capsys: pytest.CaptureFixture[str], argv: list[str], needle: str) -> None:
    try:
        rc = main(["plan", *argv])
    except SystemExit as e:  # a bad number is an argparse usage error: exit 2 with the usage line
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2
    assert "fastsync plan: error:" in err and needle in err and "Traceback" not in err
