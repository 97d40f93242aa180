"""Published ``config.json`` values of real models, as presets (dimensions only: nothing is
downloaded). Registered by the built-in plugin ``fastsync._builtin.models`` through the
``fastsync_register_models`` hook, exactly like a third-party preset would be.

Only the keys that decide parameter names and shapes are kept, copied from each model's
``config.json`` on the Hugging Face Hub.
"""

from __future__ import annotations

__all__ = ["PRESETS"]


def _qwen3_moe(**kw: object) -> dict:
    base = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": 151936,
        "head_dim": 128,
        "num_key_value_heads": 4,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "num_experts_per_tok": 8,
        "num_experts": 128,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    base.update(kw)
    return base


def _deepseek_v3(**kw: object) -> dict:
    base = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "first_k_dense_replace": 3,
        "moe_layer_freq": 1,
        "n_group": 8,
        "topk_group": 4,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "vocab_size": 129280,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    base.update(kw)
    return base


PRESETS: dict[str, dict] = {
    # Qwen/Qwen3-30B-A3B
    "qwen3-30b-a3b": _qwen3_moe(
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32,
    ),
    # Qwen/Qwen3-235B-A22B
    "qwen3-235b-a22b": _qwen3_moe(
        hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
        num_hidden_layers=94, num_attention_heads=64,
    ),
    # deepseek-ai/DeepSeek-V3 (the HF model has no MTP layer: num_nextn_predict_layers is ignored)
    "deepseek-v3": _deepseek_v3(),
    # moonshotai/Kimi-K2-Instruct: DeepSeek-V3 architecture, 384 experts, 64 heads, 1 dense layer
    "kimi-k2": _deepseek_v3(
        num_attention_heads=64, num_key_value_heads=64, n_routed_experts=384,
        first_k_dense_replace=1, n_group=1, topk_group=1, vocab_size=163840,
        model_type="kimi_k2",
    ),
    # Qwen/Qwen3-0.6B (tied embeddings)
    "qwen3-0.6b": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072,
        "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
        "head_dim": 128, "attention_bias": False, "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
    },
    # Qwen/Qwen3-8B
    "qwen3-8b": {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
        "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
        "head_dim": 128, "attention_bias": False, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    # meta-llama/Meta-Llama-3-8B
    "llama-3-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": 128256, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    # mistralai/Mixtral-8x7B-v0.1
    "mixtral-8x7b": {
        "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
        "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "num_local_experts": 8, "num_experts_per_tok": 2, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
}
