"""Bad input at every entry point: the specific inputs issue 9 found (table-driven), each refused
with a FastSyncError naming the parameter or key, exit code 2 from the CLI, no traceback, and
quickly (the unbounded ones used to run for minutes)."""

from __future__ import annotations

import json
import math
import time

import pytest
import torch

from fastsync.cli import main
from fastsync.errors import ConfigError
from fastsync.models import inventory_from_config

TINY = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 1000, "hidden_size": 64,
        "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16}
MIXTRAL = {"architectures": ["MixtralForCausalLM"], "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 96,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
           "num_experts_per_tok": 2}
PLAN = ["plan", "--model", "qwen3-0.6b", "--trainer", "fsdp:8", "--rollout", "vllm:tp1"]


def _model_dir(tmp_path, name: str, content: bytes | str | dict) -> str:
    d = tmp_path / name
    d.mkdir()
    if isinstance(content, dict):
        content = json.dumps(content)
    (d / "config.json").write_bytes(content if isinstance(content, bytes) else content.encode())
    return str(d)


def _plan_with(model: str) -> list[str]:
    return ["plan", "--model", model, "--trainer", "fsdp:8", "--rollout", "vllm:tp1"]


def _cli(argv: list[str], capsys) -> tuple[int, str, float]:
    t0 = time.monotonic()
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse usage errors
        rc = e.code
    err = capsys.readouterr().err
    return rc, err, time.monotonic() - t0


# (id, argv or a function of tmp_path returning argv, text the error must contain)
CLI_CASES = [
    ("zero3-1e8", ["plan", "--model", "qwen3-0.6b", "--trainer", "zero3:100000000", "--rollout", "vllm:tp1"],
     "field 'n' = 100000000 is over the limit 16384"),
    ("replicas-1e5", ["plan", "--model", "qwen3-0.6b", "--trainer", "fsdp:8", "--rollout", "vllm:tp1,replicas100000"],
     "field 'replicas' = 100000 is over the limit"),
    ("world-product", ["plan", "--model", "qwen3-0.6b", "--trainer", "fsdp:8", "--rollout", "vllm:tp128,dp128,replicas4"],
     "world size tp*dp*replicas = 65536 is over the limit"),
    ("megatron-product", ["plan", "--model", "qwen3-0.6b", "--trainer", "megatron:tp1024,pp64", "--rollout", "vllm:tp1"],
     "world size tp*pp*dp"),
    ("hsdp-product", ["plan", "--model", "qwen3-0.6b", "--trainer", "hsdp:1000x1000", "--rollout", "vllm:tp1"],
     "world size replicate*shard"),
    ("fsdp-1e9", ["plan", "--model", "qwen3-0.6b", "--trainer", "fsdp:1e9", "--rollout", "vllm:tp1"],
     "field 'n' must be a positive integer, got '1e9'"),
    ("unicode-digit", ["plan", "--model", "qwen3-0.6b", "--trainer", "fsdp:\u00b2", "--rollout", "vllm:tp1"],
     "layout spec 'fsdp:\u00b2'"),
    ("layers-1e7", lambda p: _plan_with(_model_dir(p, "layers", dict(TINY, num_hidden_layers=10**7))),
     "'num_hidden_layers' = 10000000 is outside 1..4096"),
    ("non-utf8", lambda p: _plan_with(_model_dir(p, "bin", b"\xff\xfe{\"a\": 1}")), "UnicodeDecodeError"),
    ("malformed-json", lambda p: _plan_with(_model_dir(p, "trunc", '{"architectures": [')), "JSONDecodeError"),
    ("json-nan", lambda p: _plan_with(_model_dir(p, "nan", json.dumps(TINY).replace('"hidden_size": 64', '"hidden_size": NaN'))),
     "NaN is not a valid config.json number"),
    ("json-not-object", lambda p: _plan_with(_model_dir(p, "list", "[1, 2]")), "not a JSON object"),
    # every command that reads a config.json refuses one that is not a JSON object, by name
    ("moe-json-not-object", lambda p: ["moe-bench", "--model", _model_dir(p, "mlist", "[1, 2]")], "not a JSON object"),
    ("delta-json-not-object", lambda p: ["delta-bench", "--model", _model_dir(p, "dlist", '"qwen3"'), "--steps", "1"],
     "not a JSON object"),
    ("moe-json-malformed", lambda p: ["moe-bench", "--model", _model_dir(p, "mtrunc", '{"model_type": ')], "JSONDecodeError"),
    ("heads-0", lambda p: _plan_with(_model_dir(p, "h0", dict(TINY, num_attention_heads=0))), "'num_attention_heads' = 0"),
    ("head-dim-1.5", lambda p: _plan_with(_model_dir(p, "hd", dict(TINY, head_dim=1.5))),
     "'head_dim' must be an integer, got 1.5"),
    ("experts-0", lambda p: _plan_with(_model_dir(p, "e0", dict(MIXTRAL, num_local_experts=0))), "'num_local_experts' = 0"),
    ("huge-dims", lambda p: _plan_with(_model_dir(p, "huge", dict(TINY, vocab_size=10**15))), "'vocab_size'"),
    ("architectures-int", lambda p: _plan_with(_model_dir(p, "arch", dict(TINY, architectures=5))), "'architectures'"),
    ("nic-nan", [*PLAN, "--nic-gbps", "nan"], "--nic-gbps: must be a finite number"),
    ("nic-tiny", [*PLAN, "--nic-gbps", "1e-300"], "--nic-gbps: must be at least 0.001"),
    ("max-transfer-inf", [*PLAN, "--max-transfer-mb", "inf"], "--max-transfer-mb: must be a finite number"),
    ("gpus-per-node-0", [*PLAN, "--gpus-per-node", "0"], "--gpus-per-node: must be at least 1"),
    ("empty-trainer", ["plan", "--model", "qwen3-0.6b", "--trainer", "", "--rollout", "vllm:tp1"], "--trainer: must not be empty"),
    ("transport-empty", ["bench", "--trainers", "1", "--rollouts", "1", "--size-gb", "0.01", "--transport", ""],
     "--transport '' names no transport"),
    ("transport-twice", ["bench", "--trainers", "1", "--rollouts", "1", "--size-gb", "0.01", "--transport", "torch,torch"],
     "names a transport twice"),
    ("size-gb-nan", ["bench", "--trainers", "1", "--rollouts", "1", "--size-gb", "nan"], "--size-gb: must be a finite number"),
    ("size-gb-0", ["bench", "--trainers", "1", "--rollouts", "1", "--size-gb", "0"], "--size-gb: must be above 0"),
    ("size-below-preset", ["bench", "--trainers", "1", "--rollouts", "1", "--model", "qwen3-0.6b", "--size-gb", "0.05"],
     "--size-gb 0.05: preset 'qwen3-0.6b' trimmed to one layer is still"),
    ("bench-too-big", ["bench", "--trainers", "1", "--rollouts", "1", "--model", "kimi-k2"], "more than this host's"),
    ("timeout-0", ["bench", "--trainers", "1", "--rollouts", "1", "--size-gb", "0.01", "--timeout", "0"],
     "--timeout: must be above 0"),
    ("timeout-neg", ["demo", "--timeout", "-1"], "--timeout: must be above 0"),
    ("staging-0", ["bench", "--trainers", "1", "--rollouts", "1", "--size-gb", "0.01", "--staging-mb", "0"],
     "--staging-mb: must be at least 1"),
    ("staging-neg", ["bench", "--trainers", "1", "--rollouts", "1", "--size-gb", "0.01", "--staging-mb", "-5"],
     "--staging-mb: must be at least 1"),
    ("trainers-1e5", ["bench", "--trainers", "100000", "--rollouts", "1", "--size-gb", "0.01"], "--trainers: 100000 is over the limit"),
    ("steps-float", ["bench", "--trainers", "1", "--rollouts", "1", "--size-gb", "0.01", "--steps", "1.5"],
     "--steps: expected an integer"),
    ("demo-transport-empty", ["demo", "--transport", ""], "--transport: must not be empty"),
    ("demo-tp-0", ["demo", "--tp", "0"], "--tp: must be at least 1"),
    ("demo-pause-mode", ["demo", "--pause-mode", "sleep"], "argument --pause-mode: invalid choice: 'sleep'"),
    ("moe-tokens-0", ["moe-bench", "--model", "qwen3-30b-a3b", "--tokens", "0"], "--tokens: must be at least 1"),
    ("moe-timeout-inf", ["moe-bench", "--model", "qwen3-30b-a3b", "--timeout", "inf"], "--timeout: must be a finite number"),
    ("plugins-extra", ["plugins", "--bogus"], "unrecognized arguments"),
    ("delta-threads-0", ["delta-bench", "--model", "qwen3-0.6b", "--steps", "1", "--threads", "0"],
     "--threads: must be at least 1"),
]


@pytest.mark.parametrize("case", CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_cli_refuses_bad_input(case, tmp_path, capsys):
    _, argv, expect = case
    if callable(argv):
        argv = argv(tmp_path)
    rc, err, seconds = _cli(argv, capsys)
    assert rc == 2, (rc, err)
    assert expect in err, err
    assert "Traceback" not in err
    assert seconds < 30, f"refused only after {seconds:.1f} s"


def test_plan_states_the_baseline_ratio_both_ways():
    from fastsync.cli.plan_cmd import _secs, baseline_ratio

    assert baseline_ratio(3.0, 1.0) == "3.0x slower than fastsync"
    assert baseline_ratio(1.0, 3.0) == "3.0x faster than fastsync"
    assert _secs(0.0123) == "0.012 s" and _secs(2e-5) == "2.00e-05 s" and _secs(12.34) == "12.3 s"


def test_plan_prints_a_nonzero_baseline(capsys):
    assert main(["plan", "--model", "qwen3-0.6b", "--trainer", "fsdp:1", "--rollout", "vllm:tp1"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("rank-0 baseline"))
    assert " 0.0 s" not in line and "than fastsync" in line, line


@pytest.mark.parametrize("kwargs,expect", [
    (dict(timeout_s=0.0), "timeout_s must be above 0"),
    (dict(timeout_s=math.nan), "timeout_s must be a finite number"),
    (dict(timeout_s=-1), "timeout_s must be above 0"),
    (dict(world_size=10**8), "world_size = 100000000 is over the limit"),
    (dict(rank=-1), "rank must be at least 0"),
    (dict(rank=1.5), "rank must be an integer"),
    (dict(transport=""), "transport must name a registered transport"),
    (dict(name=""), "name must be a non-empty string"),
    (dict(control_port=70000), "control_port = 70000 is over the limit"),
    (dict(delta="yes"), "delta must be True or False"),
    (dict(delta=True, transport="torch"), "delta=True writes over NIXL; transport='torch'"),
])
def test_weightsync_arguments(kwargs, expect):
    from fastsync import WeightSync

    args = dict(rank=0, world_size=1, control=None)
    args.update(kwargs)
    with pytest.raises(ConfigError, match="^" + expect.replace("(", r"\(")):
        WeightSync(torch.nn.Linear(2, 2), **args)


@pytest.mark.parametrize("kwargs,expect", [
    (dict(staging_bytes=0), "staging_bytes must be at least 1"),
    (dict(staging_bytes=-(1 << 20)), "staging_bytes must be at least 1"),
    (dict(timeout_s=math.inf), "timeout_s must be a finite number"),
    (dict(num_slots=0), "num_slots must be at least 1"),
])
def test_sender_arguments(kwargs, expect):
    from fastsync.sync.sender import WeightSender
    from fastsync.bench.synthetic import ModelDims, engine_layout, fsdp_layout, small_model
    from fastsync.plan.planner import build_plan

    dims = ModelDims(layers=1, hidden=64, q_dim=64, kv_dim=32, experts=2, moe_inter=32, vocab=128)
    params = small_model(dims)
    plan = build_plan(params, fsdp_layout(params, 1), engine_layout(params, dims, tp=1, expert_parallel=False))
    with pytest.raises(ConfigError, match=expect):
        WeightSender(rank=0, plan=plan, sources={}, shards={}, control=None, **kwargs)


@pytest.mark.parametrize("override,key", [
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"num_hidden_layers": 0}, "num_hidden_layers"),
    ({"hidden_size": True}, "hidden_size"),
    ({"head_dim": 64.0}, "head_dim"),
    ({"vocab_size": "1000"}, "vocab_size"),
    ({"head_dim": None, "hidden_size": 3}, "head_dim"),
    ({"model_type": ["x"], "architectures": []}, "model_type"),
])
def test_config_keys_named(override, key):
    with pytest.raises(ConfigError, match=key):
        inventory_from_config(dict(TINY, **override))


@pytest.mark.parametrize("cfg,key", [
    (dict(MIXTRAL, num_experts_per_tok=5), "num_experts_per_tok"),
    ({"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "moe_intermediate_size": 32,
      "num_experts": 0}, "num_experts"),
    ({"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 2,
      "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "moe_intermediate_size": 32,
      "num_experts": 4, "mlp_only_layers": "0"}, "mlp_only_layers"),
])
def test_moe_config_keys_named(cfg, key):
    with pytest.raises(ConfigError, match=key):
        inventory_from_config(cfg)
