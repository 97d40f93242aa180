"""The fallback path (``engines/vllm/fallback.py``): checkpoint tensors whose vLLM loader is not a
copy of a box go through vLLM's own ``load_weights`` at each flip.

On a REAL vLLM CPU engine at TP 2: GPT-2, a model vLLM serves whose loader transposes every
``Conv1D`` weight (``GPT2Model.load_weights``: ``loaded_weight.t()``), so the recorder refuses
``c_attn``, ``attn.c_proj``, ``c_fc`` and ``mlp.c_proj`` weights (4 per layer) while their
biases, the norms and the embeddings take the recorded fast path. fastsync has no hand-written
map for GPT-2. Two trainer ranks (threads, NIXL) hold FSDP2-style row shards of the HF model.
Checked: set-up names each fallback tensor, the operation and that it falls back; after a sync
the engine's greedy tokens equal the HF model's and every engine parameter's bytes equal what
vLLM's own loader makes of the trainer's weights (the same engine reloaded from the trainer's
saved checkpoint by ``model.load_weights``, digests compared); a sync one trainer rank never
sends leaves the old version, tokens and bytes, fallback parameters included.

Without an engine: the write probe, the closure over shared parameters, and the flip's
rollback when vLLM's loader fails after writing.
"""

from __future__ import annotations

import os
import sys
import time
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, os.path.dirname(__file__))

from fastsync.engines.vllm.fallback import BUFFER, Fallback, plan_fallback, probe_writes  # noqa: E402
from fastsync.errors import SyncError  # noqa: E402
from sync_rig import PROMPTS, MAX_TOKENS, SyncRig  # noqa: E402

#: 6 heads of 32 (vLLM-CPU attention sizes), split 3 + 3 at TP 2; an MLP of 300 (150 per rank); vocab 1001
GPT2 = dict(vocab_size=1001, n_embd=192, n_layer=2, n_head=6, n_inner=300, n_positions=256, initializer_range=0.2,
            bos_token_id=0, eos_token_id=0, activation_function="gelu")
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


# ---- without an engine ----------------------------------------------------------------------

class _Toy(torch.nn.Module):
    """A model with vLLM's ``load_weights`` contract whose loader transposes ``a`` into ``w`` and
    copies ``b`` into ``w``'s last row and ``c`` into ``v``; ``boom`` makes it raise after writing."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(4, 3), requires_grad=False)
        self.v = torch.nn.Parameter(torch.zeros(5), requires_grad=False)
        self.boom = False

    def load_weights(self, weights):
        for name, t in weights:
            if name == "a":
                self.w.data[:3].copy_(t.t())
            elif name == "b":
                self.w.data[3].copy_(t)
            elif name == "c":
                self.v.data.copy_(t)
            if self.boom:
                raise RuntimeError("loader gave up")
        return None


def test_probe_finds_what_each_loader_writes_without_touching_live_memory():
    pytest.importorskip("vllm")
    m = _Toy()
    got = probe_writes(m, {"a": ((3, 3), "float32"), "c": ((5,), "float32")}, {})
    assert got == {"a": {"w"}, "c": {"v"}}
    assert torch.count_nonzero(m.w) == 0 and not m.w.is_meta  # the live parameters are back, unwritten


def test_closure_takes_recordable_tensors_that_share_a_parameter_with_a_fallback():
    pytest.importorskip("vllm")
    from fastsync.engines.vllm.record import Copy, Recording

    rec = Recording(params={"a": (3, 3), "b": (3,), "c": (5,)},
                    copies={"w": [Copy("w", ((3, 4), (0, 3)), "b", ((0, 3),))], "v": [Copy("v", ((0, 5),), "c", ((0, 5),))]},
                    refused={"a": "checkpoint tensor 'a': operation t reorders its elements"})
    params = {"a": ((3, 3), "float32"), "b": ((3,), "float32"), "c": ((5,), "float32")}
    why, loads = plan_fallback(rec, params, lambda t: probe_writes(_Toy(), t, {}))
    assert sorted(why) == ["a", "b"] and "beside 'a', which falls back" in why["b"]
    assert loads == {"w": ("a", "b")}  # v keeps the fast path


def _toy_state(m: _Toy):
    from fastsync.engines.vllm.binding import VllmBinding
    from fastsync.engines.vllm.worker_state import WorkerState
    from fastsync.engines.vllm.layout import LiveParam

    live = {"w": LiveParam("w", m, "w", (4, 3), "float32", "inplace"), "v": LiveParam("v", m, "v", (5,), "float32", "inplace")}
    fb = Fallback({"a": "t", "b": "beside a"}, {"w": ("a", "b")}, {"a": (3, 3), "b": (3,)}, "float32")
    fb.allocate(live)
    fb.buffers[BUFFER + "a"].copy_(torch.arange(9.0).view(3, 3))
    fb.buffers[BUFFER + "b"].copy_(torch.tensor([7.0, 8.0, 9.0]))
    st = WorkerState(0, 0, 1, live, fb.engine_tensors())
    st.fallback = fb
    return VllmBinding(st, m), st


def test_flip_loads_the_buffers_through_the_models_own_loader():
    pytest.importorskip("vllm")
    m = _Toy()
    binding, st = _toy_state(m)
    undo: list = []
    binding.fallback_load(undo, served=0)
    assert torch.equal(m.w[:3], torch.arange(9.0).view(3, 3).t()) and torch.equal(m.w[3], torch.tensor([7.0, 8.0, 9.0]))
    assert len(undo) == 1  # the snapshot of w, kept until the flip is final
    assert torch.equal(st.fallback.buffers[BUFFER + "a"], torch.arange(9.0).view(3, 3))  # the loader had a copy


def test_a_loader_that_fails_after_writing_leaves_the_old_bytes():
    pytest.importorskip("vllm")
    m = _Toy()
    with torch.no_grad():
        m.w.fill_(-1.0)
    binding, st = _toy_state(m)
    m.boom = True
    undo: list = []
    with pytest.raises(SyncError, match=r"checkpoint tensor 'a': vLLM's load_weights failed on the fallback path "
                                        r".*loader gave up.*keeps version 0"):
        binding.fallback_load(undo, served=0)
    assert torch.equal(m.w, torch.full((4, 3), -1.0)) and undo == []


def test_peer_reload_of_an_engine_with_fallback_tensors_is_refused_by_name():
    pytest.importorskip("vllm")
    from fastsync.engines.vllm.reload import _refuse_fallback
    from fastsync.errors import ConfigError

    st = SimpleNamespace(rank=3, fallback=Fallback({"h.0.c_attn.weight": "t"}, {}, {"h.0.c_attn.weight": (2, 6)},
                                                   "float32"))
    with pytest.raises(ConfigError, match=r"engine rank 3: peer reload does not carry the 1 checkpoint tensor.*"
                                          r"'h.0.c_attn.weight'"):
        _refuse_fallback(st, "peer reload")
    _refuse_fallback(SimpleNamespace(rank=0, fallback=None), "peer reload")  # nothing falls back: no refusal


# ---- against the real vLLM CPU engine -------------------------------------------------------------

@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    pytest.importorskip("vllm")
    pytest.importorskip("nixl")
    pytest.importorskip("transformers")
    import transformers

    d = str(tmp_path_factory.mktemp("fallback") / "gpt2")
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2)).save_pretrained(d)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # auto-binding asserts on a single-NUMA host
        # the TP=2 engine's idle OpenMP threads sleep instead of spinning on 2 unpinned cores (its
        # processes read it at their start); no test here times a request against a sync
        mp.setenv("OMP_WAIT_POLICY", "PASSIVE")
        r = SyncRig(d, tp=2)
    yield r
    r.close()


def _fallback_params() -> list[str]:
    return [f"transformer.h.{i}.{s}" for i in range(GPT2["n_layer"]) for s in CONV1D]


@pytest.mark.slow
def test_set_up_names_each_fallback_tensor_its_operation_and_that_it_falls_back(rig):
    info = rig.ws[0].engine_info[0]
    assert [w["tp_size"] for w in info] == [2, 2] and all(w["layout"] == "recorded" for w in info)
    for w in info:
        fb = w["fallback"]
        assert sorted(fb) == sorted(_fallback_params())
        for name, d in fb.items():
            assert f"checkpoint tensor {name!r}: operation t reorders its elements" in d["why"], d
            assert "falls back" in d["path"] and d["loads"] == [name]  # GPT-2: engine and checkpoint names agree
        tensors = w["tensors"]
        assert all(BUFFER + n in tensors for n in fb)  # each rank gets the whole tensor for vLLM's loader
        assert all(n not in tensors for n in fb)  # those engine parameters are not on the fast path
        assert "transformer.h.0.attn.c_attn.bias" in tensors and "transformer.h.1.ln_2.weight" in tensors


@pytest.mark.slow
def test_sync_through_the_fallback_serves_the_trainers_weights_bit_for_bit(rig, tmp_path):
    from fastsync.demo.run import hf_greedy

    before = rig.engine.generate(PROMPTS, MAX_TOKENS)
    v0 = hf_greedy(rig.hf, PROMPTS, MAX_TOKENS)
    rig.step(seed=1)
    res = rig.sync()[0]
    phases = [(w["total_s"], w["fallback_s"], w["postprocess_s"]) for w in res.engines[0]]
    print(f"gpt2 sync with 8 of 29 tensors through the fallback: {res.seconds:.3f} s; per engine rank "
          f"(flip total, vLLM's load_weights, repack) s: {[tuple(round(x, 3) for x in p) for p in phases]}")
    assert all(f > 0 for _, f, _ in phases)  # the loader ran on every rank
    fb = res.fallback  # what every sync result says went the fallback way: 8 tensors on each of 2 ranks
    assert fb["tensors"] == 16 and fb["bytes"] > 0 and fb["engine_ranks"] == 2, fb
    after = rig.engine.generate(PROMPTS, MAX_TOKENS)
    want = hf_greedy(rig.hf, PROMPTS, MAX_TOKENS)
    print(f"v0 engine {before}\nv0 hf     {v0}\nv1 engine {after}\nv1 hf     {want}")
    synced = rig.digests()
    reloaded = rig.loaded_digests(str(tmp_path / "trainer"), rig.version)  # what vLLM's own loader makes of it
    for rank, (a, b) in enumerate(zip(synced, reloaded)):
        assert set(_fallback_params()) <= set(a)
        assert a == b, (rank, sorted(n for n in a if a[n] != b.get(n)))
    assert rig.engine.generate(PROMPTS, MAX_TOKENS) == after
    assert after != before, "the training step did not change the engine's greedy tokens"
    assert after == want
    assert rig.engine.version() == rig.version


@pytest.mark.slow
def test_a_sync_one_trainer_rank_never_sends_keeps_the_old_version_fallback_included(rig):
    served, before, bytes_before = rig.engine.version(), rig.engine.generate(PROMPTS, MAX_TOKENS), rig.digests()
    rig.step(seed=2)
    with pytest.raises(SyncError):
        rig.sync(ranks=(0,), timeout_s=4.0)  # rank 1 never writes its shards (of the fallback tensors too)
    assert rig.engine.version() == served
    assert rig.engine.generate(PROMPTS, MAX_TOKENS) == before
    assert rig.digests() == bytes_before
    rig.sync()  # the next complete sync lands
    from fastsync.demo.run import hf_greedy

    assert rig.engine.generate(PROMPTS, MAX_TOKENS) == hf_greedy(rig.hf, PROMPTS, MAX_TOKENS)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["delta", "staged"])
def test_delta_and_staged_syncs_carry_the_fallback_tensors(rig, mode, tmp_path):
    """The fallback buffers are engine tensors like any other: WeightSync(delta=True) patches them
    against the bytes last sent (first sync dense, then a delta of a sparse step), and
    WeightSync(staged=True) lands them off the live model; either way vLLM's loader reads them at
    the flip and the engine serves the trainer's weights bit for bit."""
    from fastsync.demo.run import hf_greedy
    from fastsync.layout.box import box_slices
    from fastsync.sync import WeightSync
    from sync_rig import TIMEOUT_S

    ws = [WeightSync(rank=r, world_size=2, control=rig.control.with_prefix(mode), engines=[rig.engine] if r == 0 else [],
                     transport="nixl", timeout_s=TIMEOUT_S, layout=rig.layout, sources=rig.sources[r], name=mode,
                     control_port=rig.control.port, **{mode: True}) for r in range(2)]

    def sparse_step(seed: int) -> None:  # 3% of every tensor moves (fallback tensors included)
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for t in rig.full.values():
                mask = torch.rand(t.shape, generator=g) < 0.03
                t[mask] += torch.randn(int(mask.sum()), generator=g, dtype=t.dtype) * 0.3 * (t.std() + 1e-3)
            for r in range(2):
                for n, ss in rig.layout.shards_on(r).items():
                    rig.sources[r][n].copy_(rig.full[n][box_slices(ss[0].box)])

    try:
        rig.run([lambda r=r: ws[r].setup() for r in range(2)])
        start = rig.engine.generate(PROMPTS, MAX_TOKENS)
        for seed in (21, 22):
            sparse_step(seed)
            rig.version += 1
            rig.run([lambda r=r: ws[r].sync(rig.version, timeout_s=TIMEOUT_S) for r in range(2)])
            after = rig.engine.generate(PROMPTS, MAX_TOKENS)
            assert after == hf_greedy(rig.hf, PROMPTS, MAX_TOKENS)
        assert after != start, "two sparse steps did not change the engine's greedy tokens"
        if mode == "delta":
            assert ws[0].last_kind == "delta"
        synced = rig.digests()
        assert synced == rig.loaded_digests(str(tmp_path / "trainer"), rig.version)
    finally:
        for w in ws:
            w.close()
