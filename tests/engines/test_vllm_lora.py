"""LoRA adapters synced in memory into a REAL vLLM CPU engine (TP=2, enable_lora=True).

One engine for the module: a tiny Qwen3 with awkward sizes (hidden 200, not a multiple of 64;
head_dim 32; intermediate 344), LoRA on q/k/v/o and gate/up/down, r = 8 then r = 12 (alpha 16:
a scaling that is not a power of two). Three adapter versions per rank; after each, the engine's
greedy tokens with the synced version equal the trainer's PEFT model's, and every slot tensor
equals, byte for byte, what vLLM's own ``add_lora`` of that version saved to disk puts in
another slot. A version whose writes never come is refused and the previous one keeps serving, and
so is one whose trainer process is killed after writing part of it.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")
pytest.importorskip("nixl")
peft = pytest.importorskip("peft")

from fastsync.control import TCPStoreControl  # noqa: E402
from fastsync.demo.run import engine_kwargs, hf_greedy  # noqa: E402
from fastsync.errors import SyncError  # noqa: E402
from fastsync.sync.lora_sync import LoraSync  # noqa: E402

pytestmark = pytest.mark.slow

KILL_JOB = str(Path(__file__).with_name("lora_kill_trainer.py"))

PROMPTS = [[5, 6, 7, 8], [100, 200, 300], [11, 42, 99, 7, 123]]
MAX_TOKENS = 6
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CONFIG = dict(vocab_size=512, hidden_size=200, intermediate_size=344, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-6,
              tie_word_embeddings=False, initializer_range=0.2, bos_token_id=1, eos_token_id=2)


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    import transformers
    from vllm import LLM

    from fastsync.engines.vllm.lora_host import VllmLoraEngine

    d = str(tmp_path_factory.mktemp("lora") / "model")
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**CONFIG)).float().save_pretrained(d)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    with pytest.MonkeyPatch.context() as mp:
        # the TP=2 engine's idle OpenMP threads sleep instead of spinning on 2 unpinned cores (its
        # processes read it at their start: 93 CPU-s for the module against 143 on the default
        # policy, docs/development.md#tests); no test here times a request against a sync
        mp.setenv("OMP_WAIT_POLICY", "PASSIVE")
        llm = LLM(**engine_kwargs(d, 2, "float32"), enable_lora=True, max_loras=3, max_lora_rank=16, max_cpu_loras=8)
    control = TCPStoreControl.server(port=0)
    yield {"dir": d, "llm": llm, "engine": VllmLoraEngine(llm), "control": control,
           "tmp": tmp_path_factory.mktemp("adapters")}
    control.close()


def _engine_greedy(llm, request) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    out = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS],
                       SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True), lora_request=request, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in out]


def _peft_model(d: str, r: int):
    import transformers
    from peft import LoraConfig, get_peft_model

    base = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    return get_peft_model(base, LoraConfig(r=r, lora_alpha=16, target_modules=TARGETS, lora_dropout=0.0)).eval()


def _new_version(pm, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)


@pytest.mark.parametrize("r", [8, 12])
def test_three_adapter_versions_match_peft_and_vllm_load(rig, r):
    from vllm.lora.request import LoRARequest

    llm, eng = rig["llm"], rig["engine"]
    pm = _peft_model(rig["dir"], r)
    ls = LoraSync(pm, control=rig["control"], engines=[eng], name=f"lora{r}", timeout_s=60.0)
    ls.setup()
    first = eng.served + 1
    base_tokens = _engine_greedy(llm, None)
    sync_s, disk_s, flip_s, disk_stall_s = [], [], [], []
    for v in range(first, first + 3):
        _new_version(pm, seed=100 * r + v)
        res = ls.sync(v)
        sync_s.append(res.seconds)
        flip_s.append(max(w["flip_s"] for w in res.engines[0]))
        assert res.bytes_sent == ls.bytes_per_version > 0
        got = _engine_greedy(llm, eng.request())
        want = hf_greedy(pm, PROMPTS, MAX_TOKENS)
        assert got == want, f"version {v}: engine {got} != PEFT {want}"
        assert got != base_tokens
        # vLLM's own path: the same version saved by PEFT, loaded by vLLM into another slot
        t0 = time.perf_counter()
        path = str(rig["tmp"] / f"r{r}v{v}")
        pm.save_pretrained(path)
        ref = LoRARequest(f"ref-r{r}-v{v}", 500 + v, path)
        t1 = time.perf_counter()
        assert llm.llm_engine.add_lora(ref)
        disk_stall_s.append(time.perf_counter() - t1)
        disk_s.append(time.perf_counter() - t0)
        cmp = eng.lora_compare(eng.lora_id(v), 500 + v)
        assert all(c["equal"] for c in cmp), f"version {v}: slot bytes differ from vLLM's load: {cmp}"
        assert llm.llm_engine.remove_lora(500 + v)
    print(f"\nr={r}: {ls.bytes_per_version} B per version; fastsync sync median {statistics.median(sync_s) * 1e3:.1f} ms "
          f"(flip {statistics.median(flip_s) * 1e3:.2f} ms); save_pretrained+add_lora median "
          f"{statistics.median(disk_s) * 1e3:.1f} ms (add_lora {statistics.median(disk_stall_s) * 1e3:.1f} ms)")
    ls.close()


def test_missing_writes_keep_the_previous_version_serving(rig):
    """An engine that begins a version whose writes never come refuses it by its deadline; the
    previous version keeps serving, and the next version succeeds."""
    llm, eng = rig["llm"], rig["engine"]
    pm = _peft_model(rig["dir"], 8)
    ls = LoraSync(pm, control=rig["control"], engines=[eng], name="lorafail", timeout_s=60.0)
    ls.setup()
    v = eng.served + 1
    _new_version(pm, seed=7)
    ls.sync(v)
    before = _engine_greedy(llm, eng.request())
    eng.lora_begin(v + 1, 2.0)  # the trainer "dies": nothing is written
    with pytest.raises(SyncError):
        eng.lora_finish(v + 1, 2.0)
    assert eng.served == v
    assert _engine_greedy(llm, eng.request()) == before
    _new_version(pm, seed=8)
    ls.sync(v + 2)
    assert _engine_greedy(llm, eng.request()) == hf_greedy(pm, PROMPTS, MAX_TOKENS)
    ls.close()


def _serve(conn, eng, proc, deadline: float) -> tuple:
    """Run the trainer process's engine calls (``lora_kill_trainer.ParentEngine``) on ``eng``
    until it says something else, and return that; bounded by ``deadline``."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0 or not conn.poll(left):
            raise AssertionError(f"the trainer process said nothing in time (exit code {proc.poll()})")
        msg = conn.recv()
        if msg[0] == "crash":
            raise AssertionError(f"the trainer process failed:\n{msg[1]}")
        if msg[0] != "call":
            return msg
        _, method, args = msg
        try:
            conn.send(("ok", getattr(eng, method)(*args)))
        except Exception as e:  # noqa: BLE001 - raised again in the trainer process, as over any RPC
            conn.send(("err", e))


def test_a_trainer_killed_mid_version_leaves_the_previous_adapter_serving(rig):
    """A trainer PROCESS (``lora_kill_trainer.py``: LoraSync with its own NIXL sender, the engine
    reached through calls back into this process) syncs version v, then is SIGKILLed once part of
    v + 1 is in the engine's staging (batch 0 drained, batch 1 posted, of several). The engine
    refuses v + 1 within its deadline, naming the dead trainer, keeps serving v (same tokens), and
    a restarted trainer's v + 2 serves the PEFT model's tokens with slot bytes equal vLLM's own load."""
    import signal
    import socket
    import subprocess
    import sys
    from multiprocessing.connection import Connection

    from vllm.lora.request import LoRARequest

    llm, eng = rig["llm"], rig["engine"]
    v = eng.served + 1
    spec = {"dir": rig["dir"], "r": 8, "alpha": 16, "targets": TARGETS, "seeds": [31, 32], "port": rig["control"].port,
            "name": "lorakill", "version": v, "timeout_s": 20.0, "max_chunk_bytes": 16 << 10}
    mine, theirs = socket.socketpair()
    proc = subprocess.Popen([sys.executable, KILL_JOB, json.dumps({**spec, "fd": theirs.fileno()})],
                            pass_fds=(theirs.fileno(),))
    theirs.close()
    conn = Connection(mine.detach())
    try:
        deadline = time.monotonic() + 120.0
        msg = _serve(conn, eng, proc, deadline)
        assert msg[:2] == ("synced", v) and msg[2] >= 3, msg  # several write batches per version
        pm = _peft_model(rig["dir"], 8)
        _new_version(pm, seed=31)
        before = _engine_greedy(llm, eng.request())
        assert eng.served == v and before == hf_greedy(pm, PROMPTS, MAX_TOKENS)
        conn.send(("go",))
        msg = _serve(conn, eng, proc, deadline)
        assert msg[0] == "chunk" and 1 <= msg[1] < msg[2] - 1, msg  # part of v + 1 written, not all
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(10.0) == -signal.SIGKILL  # reaped
        t0 = time.monotonic()
        with pytest.raises(SyncError) as refused:
            eng.lora_finish(v + 1, spec["timeout_s"])
        waited = time.monotonic() - t0
        assert waited < spec["timeout_s"] + 6.0, waited  # by its deadline (plus finish's 5 s join), not hanging
        assert f"version {v + 1}" in str(refused.value) and "trainer rank 0" in str(refused.value), refused.value
        assert eng.served == v
        assert _engine_greedy(llm, eng.request()) == before
        # the trainer restarts: a fresh LoraSync (same name, same control prefix), the next version
        ls = LoraSync(pm, control=rig["control"], engines=[eng], name="lorakill", timeout_s=60.0)
        ls.setup()
        try:
            _new_version(pm, seed=33)
            ls.sync(v + 2)
            got = _engine_greedy(llm, eng.request())
            assert got == hf_greedy(pm, PROMPTS, MAX_TOKENS) and got != before
            path = str(rig["tmp"] / "killed-then-v2")
            pm.save_pretrained(path)
            assert llm.llm_engine.add_lora(LoRARequest("ref-kill", 900, path))
            cmp = eng.lora_compare(eng.lora_id(v + 2), 900)
            assert all(c["equal"] for c in cmp), f"slot bytes differ from vLLM's load: {cmp}"
            assert llm.llm_engine.remove_lora(900)
        finally:
            ls.close()
        print(f"\nkilled trainer: refused within {waited:.2f} s: {refused.value}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10.0)
        conn.close()


def test_base_weights_through_weight_sync_into_the_lora_engine(rig):
    """The dense WeightSync writes base weights into an engine started with enable_lora=True
    (vLLM's LoRA wrappers rename the base weights to ``...base_layer.weight``; the extension
    describes the model as vLLM loaded it), by the hand-written map and by the recorded one; the
    new base serves without an adapter and under a synced adapter, then the original comes back."""
    import copy

    from fastsync.engines.vllm.handle import VllmEngine
    from fastsync.sync import WeightSync

    llm, eng = rig["llm"], rig["engine"]
    base = VllmEngine(llm)
    got = base.describe({"layout": "recorded", "prepare": False})
    assert [w["layout"] for w in got] == ["recorded", "recorded"]
    assert not any(w["fallback"] for w in got)
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(rig["dir"], dtype=torch.float32).eval()
    original = {n: p.detach().clone() for n, p in hf.named_parameters()}
    before = _engine_greedy(llm, None)
    assert before == hf_greedy(hf, PROMPTS, MAX_TOKENS)
    ws = WeightSync(hf, rank=0, world_size=1, control=rig["control"], engines=[base], control_port=rig["control"].port,
                    verify="full", name="lorabase", timeout_s=60.0)
    ws.setup()
    try:
        g = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for p in hf.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
        res = ws.sync(1)
        assert res.fallback["tensors"] == 0
        assert sum(res.metrics["bytes_per_link"].values()) >= sum(t.numel() * 4 for t in original.values())
        new_base = _engine_greedy(llm, None)
        assert new_base == hf_greedy(hf, PROMPTS, MAX_TOKENS) and new_base != before
        from peft import LoraConfig, get_peft_model

        pm = get_peft_model(copy.deepcopy(hf), LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS,
                                                          lora_dropout=0.0)).eval()  # an adapter on the new base
        ls = LoraSync(pm, control=rig["control"], engines=[eng], name="lorabase-adapter", timeout_s=60.0)
        ls.setup()
        _new_version(pm, seed=11)
        ls.sync(eng.served + 1)
        assert _engine_greedy(llm, eng.request()) == hf_greedy(pm, PROMPTS, MAX_TOKENS)
        ls.close()
        with torch.no_grad():  # the checkpoint's base again, for whatever runs next on this engine
            for n, p in hf.named_parameters():
                p.copy_(original[n])
        ws.sync(2)
        assert _engine_greedy(llm, None) == before
    finally:
        ws.close()


def test_weight_sync_of_a_peft_model_sends_the_base_once_and_the_adapter_every_version(rig):
    """``WeightSync(peft_model)``: the base (changed from the engine's checkpoint, so the engine
    cannot already hold it) goes with the first version only, the adapter with every version; the
    engine's tokens without an adapter equal the base's, with the synced version the PEFT model's.
    ``base=True`` sends the base again (here: the checkpoint's, for whatever runs next)."""
    from fastsync.engines.vllm.handle import VllmEngine
    from fastsync.sync import WeightSync
    from fastsync.sync.peft_sync import PeftWeightSync

    llm, eng = rig["llm"], rig["engine"]
    handle = VllmEngine(llm)
    handle.lora().served = eng.served  # versions above what this engine's slots already served
    pm = _peft_model(rig["dir"], 8)
    base_params = {n: p for n, p in pm.get_base_model().named_parameters() if "lora_" not in n}
    original = {n: p.detach().clone() for n, p in base_params.items()}
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in base_params.values():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    ws = WeightSync(pm, rank=0, world_size=1, control=rig["control"], engines=[handle],
                    control_port=rig["control"].port, verify="full", name="peftws", timeout_s=60.0)
    assert isinstance(ws, PeftWeightSync)
    ws.setup()
    try:
        v0 = max(eng.served, handle.version()) + 1
        base_bytes = []
        for k in range(3):
            _new_version(pm, seed=20 + k)
            res = ws.sync(v0 + k)
            base_bytes.append(0 if res.base is None else sum(res.base.metrics["bytes_per_link"].values()))
            assert res.adapter.bytes_sent == ws.lora.bytes_per_version > 0
            assert _engine_greedy(llm, ws.lora_request()) == hf_greedy(pm, PROMPTS, MAX_TOKENS), f"version {v0 + k}"
            out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], lora_request=ws.lora_request(), use_tqdm=False)
            assert ws.version_of(out[0]) == v0 + k  # each response says which adapter version made it
            with pm.disable_adapter():
                want_base = hf_greedy(pm, PROMPTS, MAX_TOKENS)
            assert _engine_greedy(llm, None) == want_base
        assert base_bytes[0] >= sum(t.numel() * 4 for t in original.values()) and base_bytes[1:] == [0, 0]
        with torch.no_grad():
            for n, p in base_params.items():
                p.copy_(original[n])
        res = ws.sync(v0 + 3, base=True)
        assert res.base is not None and res.base.fallback["tensors"] == 0
        with pm.disable_adapter():
            assert _engine_greedy(llm, None) == hf_greedy(pm, PROMPTS, MAX_TOKENS)
    finally:
        ws.close()
    eng.served = handle.lora().served  # later tests' versions go above these
