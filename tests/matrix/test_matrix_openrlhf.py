"""The sync matrix through the OpenRLHF adapter: the adapter's ``broadcast_to_vllm`` (the trainer
class ``install_trainer`` binds, options as ``--fastsync.delta`` / ``--fastsync.fanout`` set
them) on 2 real DeepSpeed ZeRO-3 ranks into two of OpenRLHF's ``RolloutRayActor`` (fastsync's
subclass) running the real vLLM CPU engine, as ``--vllm.num_engines 2`` would give. Each cell
takes real AdamW steps, then every engine tensor's bytes must equal the trainer's (gathered
ZeRO-3 weights through the plan's reference) and both engines' greedy tokens the trainer's.

Rig: ``fastsync_rigs.openrlhf_cpu`` (tests/support) (its named stand-ins: ``flash_attn``, OpenRLHF's CUDA-only
set-up). The rig starts one engine; the second is started here with the same arguments, holding
no logical GPU (the rig's Ray has one; vLLM on CPU does not use it). One rig and one pair of
engines serve every cell (about a minute to start)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("openrlhf", reason="OpenRLHF not installed (see requirements/adapters.txt)")
pytest.importorskip("deepspeed", reason="DeepSpeed not installed (see requirements/adapters.txt)")
pytest.importorskip("vllm")
pytest.importorskip("nixl._api", reason="NIXL not installed")
pytest.importorskip("ray")

sys.path.insert(0, os.path.dirname(__file__))
from matrix_support import FANOUT, assert_digest, cell_id, cell_params, first_version, reference_digest  # noqa: E402

pytestmark = pytest.mark.slow

from fastsync_rigs import STANDINS as STANDIN  # noqa: E402 - flash_attn STAND-IN (CPU host), tests/support


def _calls():
    """Trainer-actor calls run through ``__ray_call__``, defined in a function so Ray ships them by
    value (this module is not importable by name in Ray's workers)."""

    def build(self, base: int):  # the adapter's own lazy build, done first so versions continue
        t = self.trainer
        t._fastsync_sync = t._fastsync_build()
        t._fastsync_sync.setup()
        t._fastsync_sync.version = base
        return True

    def last_kind(self):
        return self.trainer._fastsync_sync.ws.last_kind

    def planned(self):  # trainer rank 0's plan: replicas planned once, relays or not
        plan = self.trainer._fastsync_sync.ws.plan
        return plan.fanout.replicas if plan.fanout is not None else 1, plan.has_relays

    def full_weights(self):  # collective: ZeRO-3 gathers on every rank
        import deepspeed

        params = list(self.engine.module.named_parameters())
        with deepspeed.zero.GatheredParameters([p for _, p in params]):
            return {n: p.data.clone() for n, p in params} if self.rank == 0 else None

    return build, last_kind, full_weights, planned


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
        yield r
    finally:
        for e in getattr(r, "engines", [])[1:]:
            try:
                r.ray.get(e.fastsync_close.remote(), timeout=30)
            except Exception:  # noqa: BLE001 - shutting down regardless
                pass
        r.close()


def _tokens(rig, engine) -> list[list[int]]:
    from vllm import SamplingParams

    from fastsync_rigs.openrlhf_cpu import MAX_TOKENS, PROMPTS

    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return [list(rig.ray.get(engine.generate.remote(p, sp), timeout=120).outputs[0].token_ids) for p in PROMPTS]


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
    build, last_kind, full_weights, planned = _calls()
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
