"""Hypothesis over the parsers: spec strings, config.json dicts and the CLI's numeric flags.
Whatever goes in, the only failures are FastSyncError (or argparse's usage exit, code 2): no
TypeError, ValueError, OverflowError or KeyError escapes, and nothing runs unbounded."""

from __future__ import annotations

import argparse
import contextlib
import io

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from fastsync.cli import build_parser
from fastsync.errors import FastSyncError
from fastsync.layout.namemap import get_name_map
from fastsync.layout.spec import engine_layout_from_spec, trainer_layout_from_spec
from fastsync.models import inventory_from_config

# derandomize: CI runs the same 300 examples every time (a failure is reproducible, never a coin toss);
# explore further locally with `pytest tests/cli/test_fuzz_parsers.py --hypothesis-seed=N`.
FUZZ = settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])

BASE = {"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 48,
        "moe_intermediate_size": 16, "num_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 2,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 8}


@pytest.fixture(scope="module")
def inv():
    return inventory_from_config(BASE)


# ---- spec strings ---------------------------------------------------------------------------

KINDS = ["fsdp", "hsdp", "zero3", "megatron", "replicated", "ddp", "vllm", "FSDP", "nope", ""]
FIELDS = ["", "tp", "pp", "dp", "ep", "replicas", "x", "r", "n", "dim", "quant", "dtype", "replicate", "shard", "s"]
NUMBERS = st.one_of(st.integers(-3, 9).map(str), st.sampled_from(["1e9", "1.5", "nan", "inf", "0x10", "\u00b2",
                                                                  "\u0663", "99999999999999999999", "16384",
                                                                  "16385", "4" * 5000, "", "fp8", "bf16"]))
ITEM = st.builds(lambda f, eq, n: f"{f}{eq}{n}", st.sampled_from(FIELDS), st.sampled_from(["", "="]), NUMBERS)
SPEC = st.one_of(
    st.text(max_size=40),
    st.builds(lambda k, sep, items: f"{k}{sep}{','.join(items)}", st.sampled_from(KINDS),
              st.sampled_from([":", "", "::"]), st.lists(ITEM, max_size=4)),
    st.builds(lambda a, b: f"hsdp:{a}x{b}", NUMBERS, NUMBERS),
)


def _small_world(layout) -> None:
    assert layout.world_size <= 16384


@FUZZ
@given(spec=SPEC)
def test_trainer_spec_parser_raises_only_fastsync_errors(inv, spec):
    try:
        _small_world(trainer_layout_from_spec(spec, inv))
    except FastSyncError:
        pass


@FUZZ
@given(spec=SPEC, dtype_out=st.sampled_from(["bf16", "fp8", "", "int4"]))
def test_engine_spec_parser_raises_only_fastsync_errors(inv, spec, dtype_out):
    try:
        _small_world(engine_layout_from_spec(spec, inv, dtype_out=dtype_out))
    except FastSyncError:
        pass


# ---- config.json dicts ----------------------------------------------------------------------

VALUES = st.one_of(
    st.integers(-2, 40), st.sampled_from([0, 1, 3, 10**7, 2**40, 2**70]),
    st.floats(allow_nan=True, allow_infinity=True), st.booleans(), st.none(), st.text(max_size=5),
    st.lists(st.integers(-1, 3), max_size=3), st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
KEYS = ["architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
        "num_experts", "num_local_experts", "n_routed_experts", "num_experts_per_tok", "num_hidden_layers",
        "num_attention_heads", "num_key_value_heads", "head_dim", "decoder_sparse_step", "mlp_only_layers",
        "attention_bias", "tie_word_embeddings", "torch_dtype", "dtype", "q_lora_rank", "kv_lora_rank",
        "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_shared_experts", "first_k_dense_replace",
        "mlp_bias", "fastsync_expert_format", "quantization_config"]
ARCHS = st.sampled_from([["Qwen3MoeForCausalLM"], ["Qwen3ForCausalLM"], ["LlamaForCausalLM"], ["MixtralForCausalLM"],
                         ["DeepseekV3ForCausalLM"], [], ["Nope"], "Qwen3ForCausalLM", [7]])
CONFIGS = st.builds(lambda arch, over: {**BASE, "architectures": arch, **over}, ARCHS,
                    st.dictionaries(st.sampled_from(KEYS), VALUES, max_size=4))


@FUZZ
@given(config=CONFIGS, fused=st.sampled_from([None, True, False]))
# found by this fuzz on a fresh clone: a quantization_config that is not an object crashed the name map
@example(config={**BASE, "architectures": ["Qwen3MoeForCausalLM"], "quantization_config": 1}, fused=None)
@example(config={**BASE, "architectures": ["Qwen3ForCausalLM"], "quantization_config": {"ignored_layers": 3}},
         fused=None)
def test_config_parser_raises_only_fastsync_errors(config, fused):
    try:
        inv = inventory_from_config(config, fused_experts=fused)
        nm = get_name_map(inv.architecture, inv.config, inv.params)
        engine_layout_from_spec("vllm:tp2", inv, name_map=nm)
    except FastSyncError:
        pass


# ---- CLI numeric flags ----------------------------------------------------------------------

NUMERIC_FLAGS = [
    ("plan", "--nic-gbps"), ("plan", "--intra-node-gbps"), ("plan", "--gpus-per-node"), ("plan", "--max-transfer-mb"),
    ("bench", "--trainers"), ("bench", "--rollouts"), ("bench", "--size-gb"), ("bench", "--steps"),
    ("bench", "--warmup"), ("bench", "--staging-mb"), ("bench", "--timeout"),
    ("demo", "--trainers"), ("demo", "--tp"), ("demo", "--repeats"), ("demo", "--max-tokens"), ("demo", "--timeout"),
    ("moe-bench", "--tokens"), ("moe-bench", "--ep"), ("moe-bench", "--reps"), ("moe-bench", "--rounds"),
    ("moe-bench", "--threads"), ("moe-bench", "--timeout"), ("moe-bench", "--seed"),
]
REQUIRED = {"plan": ["--model", "m", "--trainer", "fsdp:1", "--rollout", "vllm:tp1"],
            "bench": ["--trainers", "1", "--rollouts", "1"], "demo": [], "moe-bench": ["--model", "m"]}
NUMBER_TEXT = st.one_of(st.text(max_size=12), st.floats().map(repr), st.integers().map(str),
                        st.sampled_from(["nan", "-inf", "1e9", "1e999", "0", "-0", "1.5", "\u00b2", " 3 ", "+4"]))


@pytest.fixture(scope="module")
def parser() -> argparse.ArgumentParser:
    return build_parser()


@FUZZ
@given(which=st.sampled_from(NUMERIC_FLAGS), value=NUMBER_TEXT)
def test_cli_numbers_parse_or_exit_2(parser, which, value):
    cmd, flag = which
    with contextlib.redirect_stderr(io.StringIO()):
        try:
            args = parser.parse_args([cmd, *REQUIRED[cmd], f"{flag}={value}"])
        except SystemExit as e:
            assert e.code == 2
            return
    parsed = getattr(args, flag.lstrip("-").replace("-", "_"))
    assert isinstance(parsed, (int, float)) and parsed == parsed and parsed not in (float("inf"), float("-inf"))
