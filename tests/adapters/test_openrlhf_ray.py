"""The OpenRLHF adapter end to end, real parts on CPU: Ray with a logical GPU, OpenRLHF's own
``RolloutRayActor`` (fastsync's subclass, as ``hooks.install`` binds it) running the real vLLM CPU
engine with the combined ``WorkerWrap`` + fastsync worker extension, and 2 real DeepSpeed ZeRO-3
ranks over gloo taking real AdamW steps. The adapter's ``broadcast_to_vllm`` (the trainer class
OpenRLHF's ``ppo_actor`` module names after ``install_trainer`` ran in the trainer worker) writes
each rank's ZeRO-3 partitions into the engine; the engine's greedy tokens must then equal the
trainer model's own, step after step.

Stand-ins, named: ``flash_attn`` (tests/support/fastsync_rigs/standins: OpenRLHF imports it at top
level and it does not install on CPU), and OpenRLHF's CUDA-only set-up (``setup_distributed``,
``ActorPPOTrainer.__init__``) done by ``fastsync_rigs.openrlhf_cpu`` (tests/support) without CUDA. One engine and
one pair of trainer ranks serve every case of this module (engine start ~30 s)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("openrlhf", reason="OpenRLHF not installed (see requirements/adapters.txt)")
pytest.importorskip("deepspeed", reason="DeepSpeed not installed (see requirements/adapters.txt)")
pytest.importorskip("vllm")
pytest.importorskip("nixl._api", reason="NIXL not installed")
pytest.importorskip("ray")

pytestmark = pytest.mark.slow

from fastsync_rigs import STANDINS as STANDIN  # noqa: E402 - flash_attn STAND-IN (CPU host), tests/support


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    from fastsync_rigs.openrlhf_cpu import CpuRig, build_checkpoint

    model_dir = build_checkpoint(tmp_path_factory.mktemp("ckpt"))
    r = CpuRig(model_dir, str(tmp_path_factory.mktemp("ray")), num_trainers=2, env={"PYTHONPATH": str(STANDIN)})
    try:
        r.trainer_info = r.make_trainers()
        yield r
    finally:
        r.close()


def test_patch_is_applied_inside_the_ray_worker_processes(rig):
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
    for t in rig.trainer_info:
        assert t["pid"] != driver
        assert t["ActorPPOTrainer"] == "fastsync_openrlhf.trainer.FastSyncActorPPOTrainer"


def test_broadcast_to_vllm_makes_engine_generate_like_the_trainer_step_after_step(rig):
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


def test_samples_carry_the_weight_versions_that_generated_them(rig, tmp_path):
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
