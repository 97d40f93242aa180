"""Spec strings: the documented examples parse to the right layouts; bad specs name the field."""

from __future__ import annotations

import pytest

from fastsync import hookimpl, plugins
from fastsync.errors import ConfigError
from fastsync.layout.spec import engine_layout_from_spec, trainer_layout_from_spec
from fastsync.layout.trainer import fsdp_layout
from fastsync.models import inventory_from_config, load_inventory

CFG = {
    "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 48,
    "moe_intermediate_size": 16, "num_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 4,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 8,
}


@pytest.fixture(scope="module")
def inv():
    return inventory_from_config(CFG)


@pytest.mark.parametrize("spec,world,kind", [
    ("fsdp:256", 256, "fsdp"), ("fsdp:8,dim=0", 8, "fsdp"), ("hsdp:2x64", 128, "hsdp"),
    ("hsdp:replicate=2,shard=3", 6, "hsdp"), ("zero3:8", 8, "zero3"), ("megatron:tp8,pp2,ep4,dp2", 32, "megatron"),
    ("megatron:tp=2", 2, "megatron"), ("replicated:3", 3, "replicated"), ("ddp:2", 2, "replicated"),
    ("FSDP: 4", 4, "fsdp"),
])
def test_trainer_specs(inv, spec, world, kind):
    lay = trainer_layout_from_spec(spec, inv)
    assert lay.world_size == world and lay.kind == kind


def test_fsdp_spec_equals_builder(inv):
    assert trainer_layout_from_spec("fsdp:16", inv).to_json() == fsdp_layout(inv, 16).to_json()


@pytest.mark.parametrize("spec,world,ep", [
    ("vllm:tp8", 8, 1), ("vllm:tp2,dp4,ep", 8, 8), ("vllm:tp2,dp2,ep=4,replicas3", 12, 4),
    ("vllm:tp=4,x2", 8, 1), ("vllm:tp1,dp8,ep", 8, 8), ("vllm:tp2,ep8,replicas2", 16, 8),
])
def test_engine_specs(inv, spec, world, ep):
    lay = engine_layout_from_spec(spec, inv)
    assert lay.world_size == world and f"ep={ep}" in lay.description
    lay.validate(inv.params)


def test_engine_spec_fp8_from_dtype_out_or_field():
    inv = inventory_from_config(dict(CFG, hidden_size=256, num_attention_heads=2, num_key_value_heads=2,
                                     head_dim=128, moe_intermediate_size=256, intermediate_size=256))
    a = engine_layout_from_spec("vllm:tp2", inv, dtype_out="fp8")
    b = engine_layout_from_spec("vllm:tp2,quant=fp8", inv)
    assert a.to_json() == b.to_json()
    assert any(t.dtype == "float8_e4m3fn" for t in a.tensors[0].values())


def test_kimi_k2_perplexity_setup():
    inv = load_inventory("kimi-k2")
    trainer = trainer_layout_from_spec("fsdp:256", inv)
    engine = engine_layout_from_spec("vllm:tp8,dp4,ep,replicas4", inv, dtype_out="fp8")
    assert trainer.world_size == 256 and engine.world_size == 128
    same = engine_layout_from_spec("vllm:tp8,ep32,replicas4", inv, dtype_out="fp8")
    assert same.description == engine.description
    w13 = engine.tensors[127]["model.layers.1.mlp.experts.routed_experts.w13_weight"]
    assert w13.shape == (12, 4096, 7168) and w13.dtype == "float8_e4m3fn"  # 384 experts over EP32


@pytest.mark.parametrize("spec,match", [
    ("fsdp:abc", r"(?s)fsdp:abc.*unknown field 'abc'.*grammar"),
    ("fsdp:0", r"field 'n' must be a positive integer"),
    ("fsdp", r"expected KIND:ARGS"),
    ("nosuch:4", r"unknown trainer layout kind 'nosuch'.*fsdp"),
    ("vllm:tp2", r"'vllm' is a engine layout, not a trainer one"),
    ("megatron:pp2", r"missing field 'tp'"),
    ("megatron:tp2,tp4", r"field 'tp' given twice"),
    ("hsdp:2y3", r"unknown field"),
])
def test_bad_trainer_specs(inv, spec, match):
    with pytest.raises(ConfigError, match=match):
        trainer_layout_from_spec(spec, inv)


@pytest.mark.parametrize("spec,match", [
    ("vllm:tp8,ep4,dp4", r"field 'ep'=4: vLLM's expert-parallel group is the whole engine, tp\*dp = 32"),
    ("vllm:tp8,ep4", r"field 'ep'=4: vLLM's expert-parallel group is the whole engine, tp\*dp = 8"),
    ("vllm:dp2", r"missing field 'tp'"),
    ("vllm:tp2,quant=int4", r"field 'quant' must be fp8"),
    ("vllm:tp2,zz=1", r"unknown field 'zz'"),
    ("fsdp:4", r"'fsdp' is a trainer layout"),
])
def test_bad_engine_specs(inv, spec, match):
    with pytest.raises(ConfigError, match=match):
        engine_layout_from_spec(spec, inv)


class _ToyLayouts:
    @hookimpl
    def fastsync_register_layouts(self, register):
        register("toy", lambda args, inventory: fsdp_layout(inventory, int(args) * 2), side="trainer")


def test_third_party_layout_kind(inv):
    name = plugins.register_plugin(_ToyLayouts(), name="toy_layouts")
    try:
        assert trainer_layout_from_spec("toy:3", inv).world_size == 6
    finally:
        plugins.unregister_plugin(name)
