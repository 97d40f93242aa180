"""The sync matrix through the OpenRLHF adapter: the adapter's ``broadcast_to_vllm`` (the trainer
class ``install_trainer`` binds, options as ``--fastsync.delta`` / ``--fastsync.fanout`` set
them) on 2 real DeepSpeed ZeRO-3 ranks into two of OpenRLHF's ``RolloutRayActor`` (fastsync's
subclass) running the real vLLM CPU engine, as ``--vllm.num_engines 2`` would give. Each cell
takes real AdamW steps, then every engine tensor's bytes must equal the trainer's (gathered
ZeRO-3 weights through the plan's reference) and both engines' greedy tokens the trainer's.

First, on the rig's first engine, the adapter as OpenRLHF runs it (these were
``tests/adapters/test_openrlhf_ray.py``, which built the same rig again): the rollout actor is
fastsync's ``RolloutRayActor`` subclass, each vLLM worker carries OpenRLHF's ``WorkerWrap`` and
fastsync's extension and neither imported DeepSpeed, each trainer worker's ``ppo_actor`` names
fastsync's trainer; ``broadcast_to_vllm`` after each of two real AdamW steps makes the engine
generate like the trainer; OpenRLHF's own ``generate_responses`` labels each sample with the
weight versions that generated it, across a sync too.

Rig: ``fastsync_rigs.openrlhf_cpu`` (tests/support) (its named stand-ins: ``flash_attn``, OpenRLHF's CUDA-only
set-up). The rig starts one engine; the second is started here with the same arguments, holding
no logical GPU (the rig's Ray has one; vLLM on CPU does not use it). One rig and one pair of
engines serve every cell (about a minute to start).

The MoE cells (``test_openrlhf_moe``): a Qwen3-MoE with awkward sizes
(the ``awkward-qwen3-moe`` preset of ``fastsync.demo.checkpoints``) built the way OpenRLHF's ``PolicyModelActor`` builds its
actor: ``install_trainer`` (so ``--fastsync.moe`` rebinds ``ppo_actor.Actor``), then OpenRLHF's
``Actor`` constructed partitioned under ZeRO-3 (``HfDeepSpeedConfig``), then ``deepspeed.initialize``.
Without the swap the experts are HF's fused ``gate_up_proj`` / ``down_proj`` ZeRO-3 partitions;
with ``--fastsync.moe auto`` each block is fastsync's. Either way every MoE engine tensor's bytes
(vLLM's fused ``w13`` / ``w2`` experts included) must equal the gathered trainer weights through
the plan's reference, and the engine's greedy tokens the trainer's. One more engine serves both
MoE cells (its versions continue). When the dense rig is up, that engine joins its Ray (holding no
Ray CPU or GPU: the dense actors hold them all, idle by then) and the dense rig's trainer ranks
rebuild their policy from the MoE checkpoint (as the LoRA cell does from the dense one); else the
MoE cells get a rig of their own (``-k moe``: about a minute).

The LoRA cell (``test_openrlhf_lora``, OpenRLHF's ``--ds.lora.rank 8`` on q/k/v/o/gate/up/down):
the dense rig's trainer ranks rebuild their policy as OpenRLHF's ``Actor`` with LoRA (a PEFT model,
ZeRO-3), the adapters train (nonzero after the first AdamW step, different after each), and the
adapter's ``broadcast_to_vllm`` sends the merged policy into both engines (started without LoRA,
as OpenRLHF starts them): every engine tensor's bytes must equal PEFT's ``merge_and_unload()`` of
the gathered trainer model, and the engines' greedy tokens the trainer's PEFT model's own. It runs
last on the dense rig (its trainer ranks keep the LoRA policy)."""

from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("openrlhf", reason="OpenRLHF not installed (see requirements/adapters.txt)")
pytest.importorskip("deepspeed", reason="DeepSpeed not installed (see requirements/adapters.txt)")
pytest.importorskip("vllm")
pytest.importorskip("nixl._api", reason="NIXL not installed")
pytest.importorskip("ray")

sys.path.insert(0, os.path.dirname(__file__))
from matrix_support import (  # noqa: E402
    FANOUT,
    MOE_PROMPTS,
    assert_digest,
    cell_id,
    cell_params,
    first_version,
    reference_digest,
)

pytestmark = pytest.mark.slow

from fastsync_rigs import STANDINS as STANDIN  # noqa: E402 - flash_attn STAND-IN (CPU host), tests/support
from openrlhf_calls import actor_build, calls, lora_reference  # noqa: E402 - shipped to the ranks by value


#: the dense rig while it is up (the MoE cells start their engine and ranks in its Ray)
_LIVE: dict = {}


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    from fastsync_rigs.openrlhf_cpu import CpuRig, build_checkpoint
    from fastsync_openrlhf.rollout import OPENRLHF_EXTENSION, FastSyncRolloutRayActor

    model_dir = build_checkpoint(tmp_path_factory.mktemp("ckpt"))
    r = CpuRig(model_dir, str(tmp_path_factory.mktemp("ray")), num_trainers=2, env={"PYTHONPATH": str(STANDIN)})
    try:
        second = FastSyncRolloutRayActor.options(  # the rig's engine arguments, no logical GPU
            num_cpus=1, num_gpus=0, runtime_env={"env_vars": {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}}).remote(
            model=model_dir, enforce_eager=True, worker_extension_cls=OPENRLHF_EXTENSION, tensor_parallel_size=1,
            seed=0, distributed_executor_backend="uni", max_model_len=256, enable_prefix_caching=False,
            dtype="float32", trust_remote_code=True, full_determinism=False, bundle_indices=None, num_gpus=1,
            enable_sleep_mode=False, skip_tokenizer_init=True, kv_cache_memory_bytes=64 << 20)
        r.ray.get(second.get_num_unfinished_requests.remote(), timeout=300)
        r.engines = [r.engine, second]
        r.described = r.ray.get(r.engine.fastsync_describe.remote({}), timeout=120)[0]["tensors"]
        _LIVE["rig"] = r
        yield r
    finally:
        _LIVE.pop("rig", None)
        for e in getattr(r, "engines", [])[1:]:
            try:
                r.ray.get(e.fastsync_close.remote(), timeout=30)
            except Exception:  # noqa: BLE001 - shutting down regardless
                pass
        r.close()


def _tokens(rig, engine, prompts=None) -> list[list[int]]:
    from vllm import SamplingParams

    from fastsync_rigs.openrlhf_cpu import MAX_TOKENS, PROMPTS

    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [list(rig.ray.get(engine.generate.remote(p, sp), timeout=120).outputs[0].token_ids)
            for p in (PROMPTS if prompts is None else prompts)]


# ---- the adapter on the rig's first engine, before the cells (the versions from 1; the cells' from 10) ----
@pytest.fixture(scope="module")
def adapter_trainers(rig) -> list[dict]:
    """The adapter's trainer on both ranks with its default options, writing the rig's first engine
    (the trainer class ``install_trainer`` binds in each trainer worker): what OpenRLHF's
    ``ppo_actor`` names there."""
    return rig.make_trainers()


def test_patch_is_applied_inside_the_ray_worker_processes(rig, adapter_trainers):
    """Checked in the workers themselves: the rollout actor is fastsync's RolloutRayActor
    subclass, every vLLM worker carries OpenRLHF's WorkerWrap AND fastsync's extension, neither
    imported DeepSpeed; each trainer worker's ppo_actor names fastsync's trainer class."""
    rep = rig.engine_report()
    driver = os.getpid()
    assert rep["pid"] != driver
    assert rep["actor_mro"][0] == "fastsync_openrlhf.rollout.FastSyncRollout"
    assert "openrlhf.trainer.ray.vllm_engine.RolloutRayActor" in rep["actor_mro"]
    assert not rep["deepspeed_imported"]
    assert rep["workers"], "no vLLM worker answered"
    for w in rep["workers"]:
        assert w["pid"] not in (driver, rep["pid"])
        assert "openrlhf.trainer.ray.vllm_worker_wrap.WorkerWrap" in w["mro"]
        assert any(c.startswith("fastsync.engines.") and c.endswith(".FastSyncWorkerExtension") for c in w["mro"])
        assert not w["deepspeed_imported"], "a vLLM process imported DeepSpeed"
    for t in adapter_trainers:
        assert t["pid"] != driver
        assert t["ActorPPOTrainer"] == "fastsync_openrlhf.trainer.FastSyncActorPPOTrainer"


def test_broadcast_to_vllm_makes_engine_generate_like_the_trainer_step_after_step(rig, adapter_trainers):
    versions = []
    previous = None
    for step in (1, 2):
        losses = rig.train_step(seed=step)  # a real ZeRO-3 AdamW step: every weight moves
        assert len(set(losses)) == 1
        want = rig.trainer_tokens()
        assert want != previous, "the training step did not change the greedy tokens; the check would be vacuous"
        assert rig.engine_tokens() != want, "engine already generates like the new weights before the sync"
        got = rig.broadcast_to_vllm()
        assert [g["version"] for g in got] == [step, step]
        assert rig.engine_tokens() == want, f"step {step}: engine tokens differ from the trainer model's"
        versions.append(rig.engine_version())
        previous = want
    assert versions == [[1], [2]]


def test_samples_carry_the_weight_versions_that_generated_them(rig, adapter_trainers, tmp_path):
    """OpenRLHF's own ``generate_responses`` (its SingleTurnAgentExecutor, a real word-level HF
    tokenizer) on fastsync's rollout actor: each response carries ``weight_versions`` and, in the
    ``extra_logs`` OpenRLHF turns into ``Experience.info``, ``weight_version_min/max``; a sample
    whose generation runs across a sync (held in the engine by OpenRLHF's own ``pause_generation``,
    as its async trainer does) carries both versions, the new one from a token index inside it."""
    import time

    import transformers
    from vllm import SamplingParams

    from fastsync_rigs.verl_cpu import write_word_tokenizer

    model_dir = rig.model_dir
    tok_dir = tmp_path / "tok"
    write_word_tokenizer(str(tok_dir), transformers.AutoConfig.from_pretrained(model_dir).vocab_size)
    tok = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    served = rig.engine_version()[0]
    short = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    got = rig.ray.get(rig.engine.generate_responses.remote("t5 t6 t7", "", short, 64, tok, 2), timeout=120)
    assert len(got) == 2
    for r in got:
        assert r["weight_versions"] == [[[served, 0]]], r["weight_versions"]  # one generate call, one span
        assert (r["extra_logs"]["weight_version_min"], r["extra_logs"]["weight_version_max"]) == (served, served)
    rig.train_step(seed=served + 1)
    long = SamplingParams(max_tokens=240, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()  # how long this machine takes for the whole request, to pause a quarter in
    rig.ray.get(rig.engine.generate_responses.remote("t5 t6 t7", "", long, 256, tok, 1), timeout=300)
    whole_s = time.perf_counter() - t0
    ref = rig.engine.generate_responses.remote("t5 t6 t7", "", long, 256, tok, 1)
    time.sleep(whole_s / 4)  # decoding: some tokens on the old weights
    # as OpenRLHF's async trainer does around a sync: the request is held in the engine (keep), so it
    # is certainly in flight at the flip however fast this machine decodes; fastsync then does not
    # pause again, and labels the new weights before the resume
    rig.ray.get(rig.engine.pause_generation.remote(), timeout=60)
    try:
        assert rig.ray.get(rig.engine.get_num_unfinished_requests.remote(), timeout=60) == 1, "finished before the sync"
        assert [g["version"] for g in rig.broadcast_to_vllm()] == [served + 1] * 2
    finally:
        rig.ray.get(rig.engine.resume_generation.remote(), timeout=60)
    [r] = rig.ray.get(ref, timeout=300)
    [spans] = r["weight_versions"]
    assert [v for v, _ in spans] == [served, served + 1], spans  # it ran across the flip
    assert spans[0][1] == 0 and 0 < spans[1][1] < 240, spans
    assert (r["extra_logs"]["weight_version_min"], r["extra_logs"]["weight_version_max"]) == (served, served + 1)


@pytest.mark.parametrize("cell", cell_params())
def test_openrlhf_matrix(rig, cell):
    import argparse

    from fastsync_openrlhf.config import FastSyncOptions, add_arguments

    payload, route = cell
    ap = argparse.ArgumentParser()
    add_arguments(ap)  # the launcher's --fastsync.* flags, as a user gives them
    flags = ["--fastsync.fanout", FANOUT[route]] + (["--fastsync.delta"] if payload == "delta" else [])
    opts = {k.split(".", 1)[1]: v for k, v in vars(ap.parse_args(flags)).items()}
    FastSyncOptions(**opts).validate()  # what options_from_args checks in the trainer worker
    opts["control_host"] = rig.control_host
    build, last_kind, full_weights, planned = calls()
    ray, version = rig.ray, first_version(cell)
    ray.get([t.close.remote() for t in rig.trainers], timeout=60)  # the previous cell's session
    ray.get([t.make_trainer.remote(rig.engines, opts) for t in rig.trainers], timeout=120)
    ray.get([t.__ray_call__.remote(build, version - 1) for t in rig.trainers], timeout=300)
    assert ray.get(rig.trainers[0].__ray_call__.remote(planned), timeout=60) == (2, route == "relayed")
    for step in range(2 if payload == "delta" else 1):
        rig.train_step(seed=version + step)  # a real ZeRO-3 AdamW step: every weight moves
        want = rig.trainer_tokens()
        got = rig.broadcast_to_vllm()
        assert [g["version"] for g in got] == [version + step] * 2
        if payload == "delta":  # dense first, then a delta
            assert ray.get(rig.trainers[0].__ray_call__.remote(last_kind), timeout=60) == ("delta" if step else "dense")
        full = ray.get([t.__ray_call__.remote(full_weights) for t in rig.trainers], timeout=120)[0]
        want_bytes = reference_digest(full, rig.described)
        for i, e in enumerate(rig.engines):
            digest = ray.get(e._rpc.remote("fastsync_digest"), timeout=60)[0]
            assert digest["version"] == version + step, (i, digest.get("version"))
            assert_digest(digest["tensors"], want_bytes, f"{cell_id(cell)} step {step}, engine {i}")
            assert _tokens(rig, e) == want, f"{cell_id(cell)} step {step}, engine {i}: tokens differ from the trainer's"


@pytest.fixture(scope="module")
def moe_rig(tmp_path_factory):
    """One vLLM CPU engine serving the MoE checkpoint and two ZeRO-3 trainer ranks: when the dense
    rig is up, an engine in its Ray (its one logical GPU and its CPUs are held by the dense actors:
    this one holds none) and the dense rig's trainer ranks, whose torch.distributed world serves any
    model (each cell builds its policy from the MoE checkpoint with ``openrlhf_calls.actor_build``,
    as the LoRA cell does from the dense one); else a rig of their own."""
    from types import SimpleNamespace

    from fastsync_rigs.openrlhf_cpu import CpuRig, release
    from fastsync_openrlhf.rollout import OPENRLHF_EXTENSION, FastSyncRolloutRayActor

    from fastsync.demo.checkpoints import build_tiny_checkpoint

    model_dir = str(build_tiny_checkpoint("awkward-qwen3-moe", tmp_path_factory.mktemp("moe_ckpt"), dtype="float32"))
    host = _LIVE.get("rig")
    own = None
    if host is None:
        own = CpuRig(model_dir, str(tmp_path_factory.mktemp("ray_moe")), num_trainers=2,
                     env={"PYTHONPATH": str(STANDIN)})
        m = SimpleNamespace(ray=own.ray, engine=own.engine, trainers=own.trainers, control_host=own.control_host)
    else:
        ray = host.ray
        engine = FastSyncRolloutRayActor.options(  # the rig's engine arguments, no CPU or GPU held
            num_cpus=0, num_gpus=0, runtime_env={"env_vars": {"VLLM_CPU_OMP_THREADS_BIND": "nobind"}}).remote(
            model=model_dir, enforce_eager=True, worker_extension_cls=OPENRLHF_EXTENSION, tensor_parallel_size=1,
            seed=0, distributed_executor_backend="uni", max_model_len=256, enable_prefix_caching=False,
            dtype="float32", trust_remote_code=True, full_determinism=False, bundle_indices=None, num_gpus=1,
            enable_sleep_mode=False, skip_tokenizer_init=True, kv_cache_memory_bytes=64 << 20)
        m = SimpleNamespace(ray=ray, engine=engine, trainers=host.trainers, control_host=host.control_host)
    try:
        m.model_dir = model_dir
        m.ray.get(m.engine.get_num_unfinished_requests.remote(), timeout=300)
        m.ray.get([t.__ray_ready__.remote() for t in m.trainers], timeout=300)
        m.described = m.ray.get(m.engine.fastsync_describe.remote({}), timeout=120)[0]["tensors"]
        yield m
    finally:
        if own is not None:
            own.close()
        else:  # the trainer ranks go with the dense rig
            release(m.ray, [], m.engine)
            m.ray.kill(m.engine)


MOE_CELLS = [pytest.param("off", id="moe-swap-off"), pytest.param("auto", id="moe-swap-on")]


@pytest.mark.parametrize("moe", MOE_CELLS)
def test_openrlhf_moe(moe_rig, moe):
    """A ZeRO-3 MoE policy through the adapter's ``broadcast_to_vllm`` into the live engine, with
    and without ``--fastsync.moe`` (see the module doc); two syncs, each after a real AdamW step."""
    import argparse

    from fastsync_openrlhf.config import FastSyncOptions, add_arguments
    from fastsync_rigs.openrlhf_cpu import MAX_TOKENS

    m = moe_rig
    experts = sorted(n for n in m.described if ".mlp.experts." in n)  # vLLM's fused w13 / w2, padded
    assert len(experts) == 4 and all(n.endswith(("w13_weight", "w2_weight")) for n in experts), experts
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    opts = {k.split(".", 1)[1]: v for k, v in vars(ap.parse_args(["--fastsync.moe", moe])).items()}
    FastSyncOptions(**opts).validate()
    opts["control_host"] = m.control_host
    build, _, full_weights, planned = calls()
    ray, version = m.ray, 10 * (1 + [p.values[0] for p in MOE_CELLS].index(moe))
    built = ray.get([t.__ray_call__.remote(actor_build(), m.model_dir, opts) for t in m.trainers], timeout=300)
    mlps = ["model.layers.0.mlp", "model.layers.1.mlp"]
    for b in built:
        assert b["partitioned"], "OpenRLHF's Actor was not built partitioned (zero.Init)"
        assert sorted(b["blocks"]) == mlps, b["blocks"]
        if moe == "off":
            assert b["swapped"] == [] and set(b["blocks"].values()) == {"Qwen3MoeSparseMoeBlock"}, b
        else:
            assert b["swapped"] == mlps and set(b["blocks"].values()) == {"fastsync"}, b
    ray.get([t.make_trainer.remote([m.engine], opts) for t in m.trainers], timeout=120)
    ray.get([t.__ray_call__.remote(build, version - 1) for t in m.trainers], timeout=300)
    assert ray.get(m.trainers[0].__ray_call__.remote(planned), timeout=60) == (1, False)  # one engine, direct
    for step in range(2):
        ray.get([t.train_step.remote(version + step) for t in m.trainers], timeout=300)  # every weight moves
        want = ray.get([t.trainer_tokens.remote(MOE_PROMPTS, MAX_TOKENS) for t in m.trainers], timeout=300)[0]
        full = ray.get([t.__ray_call__.remote(full_weights) for t in m.trainers], timeout=120)[0]
        want_bytes = reference_digest(full, m.described)
        if step:  # the check has teeth: the engine still holds the previous sync's bytes, every one stale
            stale = ray.get(m.engine._rpc.remote("fastsync_digest"), timeout=60)[0]["tensors"]
            assert all(stale[n] != want_bytes[n] for n in want_bytes), "a trained tensor's bytes did not move"
        got = ray.get([t.broadcast_to_vllm.remote() for t in m.trainers], timeout=300)
        assert [g["version"] for g in got] == [version + step] * 2
        digest = ray.get(m.engine._rpc.remote("fastsync_digest"), timeout=60)[0]
        assert digest["version"] == version + step, digest.get("version")
        assert_digest(digest["tensors"], want_bytes, f"moe {moe} step {step}")
        assert _tokens(m, m.engine, MOE_PROMPTS) == want, f"moe {moe} step {step}: tokens differ from the trainer's"


#: OpenRLHF's Actor arguments for ``--ds.lora.rank 8 --ds.lora.alpha 16 --ds.lora.target_modules ...``
LORA = {"lora_rank": 8, "lora_alpha": 16, "lora_dropout": 0.0,
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}


def test_openrlhf_lora(rig):
    """``--ds.lora.rank 8``: the merged policy reaches both engines, two steps (see the module doc)."""
    import argparse

    from matrix_support import CELLS

    from fastsync_openrlhf.config import FastSyncOptions, add_arguments
    from fastsync_rigs.openrlhf_cpu import MAX_TOKENS, PROMPTS

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    opts = {k.split(".", 1)[1]: v for k, v in vars(ap.parse_args([])).items()}
    FastSyncOptions(**opts).validate()
    opts["control_host"] = rig.control_host
    build, _, _, _ = calls()
    ray, version = rig.ray, 10 * (len(CELLS) + 1)  # after every dense cell's block on these engines
    ray.get([t.close.remote() for t in rig.trainers], timeout=60)  # the previous cell's session
    ray.get([t.__ray_call__.remote(actor_build(), rig.model_dir, opts, LORA) for t in rig.trainers], timeout=300)
    ray.get([t.make_trainer.remote(rig.engines, opts) for t in rig.trainers], timeout=120)
    ray.get([t.__ray_call__.remote(build, version - 1) for t in rig.trainers], timeout=300)
    for step in range(2):
        rig.train_step(seed=version + step)  # a real ZeRO-3 AdamW step of the adapters (the base is frozen)
        ref = ray.get([t.__ray_call__.remote(lora_reference(), LORA, PROMPTS, MAX_TOKENS)
                       for t in rig.trainers], timeout=300)[0]
        assert ref["num_lora_b"] == 2 * 7 and not ref["lora_b_zero"], "the adapters are zero: the check has no teeth"
        want_bytes = reference_digest(ref["merged"], rig.described)
        targeted = {n for n in want_bytes if n.split(".")[-2] in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")}
        assert len(targeted) == 4 * 2, sorted(targeted)  # vLLM's fused names, 2 layers
        if step:  # the engines hold the first step's merge: the adapters moved, the frozen base did not
            stale = ray.get(rig.engines[0]._rpc.remote("fastsync_digest"), timeout=60)[0]["tensors"]
            moved = {n for n in want_bytes if stale[n] != want_bytes[n]}
            assert moved == targeted, sorted(moved ^ targeted)
        got = rig.broadcast_to_vllm()
        assert [g["version"] for g in got] == [version + step] * 2
        for i, e in enumerate(rig.engines):
            digest = ray.get(e._rpc.remote("fastsync_digest"), timeout=60)[0]
            assert digest["version"] == version + step, (i, digest.get("version"))
            assert_digest(digest["tensors"], want_bytes, f"lora step {step}, engine {i}")
            assert _tokens(rig, e) == ref["tokens"], f"lora step {step}, engine {i}: tokens differ from the PEFT model's"
