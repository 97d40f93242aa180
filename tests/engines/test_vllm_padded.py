"""Engines pad shapes: vLLM pads the vocabulary to a multiple of 64 (here 1000 -> 1024 rows at
TP 1). Destination shapes come from the live engine: fastsync writes the logical rows of the
padded embedding / lm_head and leaves the padding as the engine made it; ``describe`` records
both shapes. Tiny Llama and Qwen3 models with vocab 1000 and hidden 200 (not multiples of 64)
sync into the REAL vLLM CPU engine and then generate exactly what the trainer's HF model does.
One engine per model, started one after the other and stopped after use."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")
pytest.importorskip("nixl")
transformers = pytest.importorskip("transformers")

from fastsync.control import TCPStoreControl  # noqa: E402
from fastsync.demo.run import engine_kwargs, hf_greedy  # noqa: E402
from fastsync.engines.vllm.layout import LiveParam, check_against  # noqa: E402
from fastsync.errors import LayoutError  # noqa: E402
from fastsync.layout.box import box_slices  # noqa: E402
from fastsync.layout.trainer import fsdp_layout  # noqa: E402
from fastsync.layout.types import EngineTensor, ParamSpec  # noqa: E402
from fastsync.sync import WeightSync  # noqa: E402

PROMPTS = [[5, 6, 7, 8], [100, 200, 300], [11, 42, 99, 7, 123]]
AWKWARD = dict(vocab_size=1000, hidden_size=200, intermediate_size=300, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=64, max_position_embeddings=256)
MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", AWKWARD),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", AWKWARD),
}


def test_padded_rows_are_accepted_only_as_a_prefix_of_inplace_memory():
    module = torch.nn.Embedding(1024, 8)
    live = {"e": LiveParam("e", module, "weight", (1024, 8), "float32", "inplace")}
    check_against(live, {"e": EngineTensor("e", (1000, 8), "float32", ())}, rank=0)
    assert live["e"].logical_shape == (1000, 8)
    view = live["e"].live
    assert view.shape == (1000, 8) and view.data_ptr() == module.weight.data_ptr() and view.is_contiguous()
    # more columns, fewer rows than expected, or a prepacked (staged) parameter: still refused
    for shape, kind in (((1024, 9), "inplace"), ((999, 8), "inplace"), ((1024, 8), "linear_repack")):
        live = {"e": LiveParam("e", module, "weight", shape, "float32", kind)}
        with pytest.raises(LayoutError, match="local shape"):
            check_against(live, {"e": EngineTensor("e", (1000, 8), "float32", ())}, rank=0)


@pytest.mark.slow
@pytest.mark.parametrize("which", sorted(MODELS))
def test_padded_vocab_syncs_into_real_vllm(which, tmp_path):
    from vllm import LLM

    from fastsync.engines.vllm.host import VllmEngine

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
        described = engine.describe()
        assert described[0]["padded"]["model.embed_tokens.weight"] == {"logical": [1000, 200], "engine": [1024, 200]}
        ws.setup()
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
    finally:
        ws.close()
        llm.collective_rpc("fastsync_close")
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception:  # noqa: BLE001 - a worker already gone is stopped either way
            pass
