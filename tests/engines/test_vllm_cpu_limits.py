"""What vLLM-CPU cannot start is said before an engine starts (``fastsync.engines.vllm.cpu_limits``),
with the rule read from vLLM's own classes: a head size its CPU attention does not take, a MoE
model whose hidden size its CPU MoE kernel cannot tile. No engine starts here."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM not installed")

from fastsync.engines.vllm.cpu_limits import check_cpu_engine, cpu_engine_needs  # noqa: E402
from fastsync.errors import ConfigError  # noqa: E402

MOE = {"hidden_size": 96, "num_attention_heads": 6, "head_dim": 32, "num_experts": 5, "moe_intermediate_size": 44}


def test_awkward_sizes_vllm_cpu_takes_pass() -> None:
    assert cpu_engine_needs(MOE) == []  # hidden 96, head 32, intermediate 44 (padded by the kernel)
    assert cpu_engine_needs({"hidden_size": 200, "num_attention_heads": 5, "head_dim": 64}) == []  # dense: any hidden


def test_each_broken_rule_is_named_with_the_models_sizes() -> None:
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    needs = cpu_engine_needs({**MOE, "hidden_size": 88, "head_dim": 16})
    assert len(needs) == 2, needs
    assert "head size 16" in needs[0] and "CPUAttentionBackend" in needs[0]
    assert "hidden_size 88" in needs[1] and f"multiple of {CPUUnquantizedExperts.output_alignment}" in needs[1]
    # head size from hidden / heads when head_dim is absent; nested text_config (multimodal) read too
    assert "head size 20" in cpu_engine_needs({"text_config": {"hidden_size": 100, "num_attention_heads": 5}})[0]


def test_mla_and_quantized_moe_are_left_to_their_own_checks() -> None:
    assert cpu_engine_needs({"hidden_size": 88, "num_attention_heads": 6, "kv_lora_rank": 512, "n_routed_experts": 5,
                             "quantization_config": {"quant_method": "fp8"}}) == []


def test_check_refuses_naming_the_checkpoint() -> None:
    with pytest.raises(ConfigError, match=r"--model /x: vLLM-CPU cannot start this model: .*hidden_size 88"):
        check_cpu_engine({**MOE, "hidden_size": 88}, "--model /x")
