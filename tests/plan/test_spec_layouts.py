"""The planner on layouts built by ``fastsync.layout.spec`` from tiny real configs (Qwen3-MoE,
DeepSeek-V3 with MLA and shared experts): bit-exact against the reference, every destination
element written once, bf16 and FP8 out."""

from __future__ import annotations

import pytest
import torch

from fastsync.bench.local import execute_plan_locally, reference_engine_tensors, split_full_params, write_counts
from fastsync.layout.spec import engine_layout_from_spec, trainer_layout_from_spec
from fastsync.models import inventory_from_config
from fastsync.plan.planner import build_plan

QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 512, "hidden_size": 256,
    "intermediate_size": 512, "moe_intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 4, "head_dim": 64, "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 512, "hidden_size": 256,
    "intermediate_size": 512, "moe_intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 4, "q_lora_rank": 256, "kv_lora_rank": 128, "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 64, "v_head_dim": 64, "n_routed_experts": 4, "n_shared_experts": 1,
    "num_experts_per_tok": 2, "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_group": 1, "topk_group": 1, "topk_method": "noaux_tc",
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


@pytest.mark.parametrize("config", [QWEN3_MOE, DEEPSEEK_V3], ids=["qwen3-moe", "deepseek-v3"])
@pytest.mark.parametrize("trainer_spec, rollout_spec, dtype_out", [
    ("fsdp:3", "vllm:tp2,replicas2", "fp8"),
    ("hsdp:2x2", "vllm:tp2,dp2,ep", "bf16"),
    ("zero3:5", "vllm:tp1,replicas2", "fp8"),
    ("megatron:tp2,pp2", "vllm:tp2,dp2,ep", "fp8"),
])
def test_spec_layouts_execute_bit_exact(config: dict, trainer_spec: str, rollout_spec: str, dtype_out: str) -> None:
    inv = inventory_from_config(dict(config), name="tiny")
    trainer = trainer_layout_from_spec(trainer_spec, inv)
    engine = engine_layout_from_spec(rollout_spec, inv, dtype_out=dtype_out)
    plan = build_plan(inv.params, trainer, engine, allow_unread=True)
    assert plan.meta["unread_params"] == []
    counts = write_counts(plan, engine)
    assert all(int(c.min()) == 1 and int(c.max()) == 1 for d in counts.values() for c in d.values())
    g = torch.Generator().manual_seed(0)
    full = {n: torch.randn(p.shape, generator=g).to(torch.bfloat16) for n, p in inv.params.items()}
    got = execute_plan_locally(plan, split_full_params(full, trainer), engine, trainer)
    ref = reference_engine_tensors(full, engine)
    for rank in ref:
        for name in ref[rank]:
            assert torch.equal(_bits(got[rank][name]), _bits(ref[rank][name])), (rank, name)
