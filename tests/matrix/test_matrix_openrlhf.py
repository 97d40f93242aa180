"""The sync matrix through the OpenRLHF adapter: the adapter's ``broadcast_to_vllm`` (the trainer
class ``install_trainer`` binds, options as ``--fastsync.delta`` / ``--fastsync.fanout`` set
them) on 2 real DeepSpeed ZeRO-3 ranks into two of OpenRLHF's ``RolloutRayActor`` (fastsync's
subclass) running the real vLLM CPU engine, as ``--vllm.num_engines 2`` would give. Each cell
takes real AdamW steps, then every engine tensor's bytes must equal the trainer's (gathered
ZeRO-3 weights through the plan's reference) and both engines' greedy tokens the trainer's.

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
from pathlib import Path

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


def _actor_build():
    """The trainer-rank call that builds the policy as OpenRLHF's ``PolicyModelActor`` does, shipped
    by value through ``__ray_call__`` (see :func:`_calls`)."""

    def build_actor(self, model_dir: str, opts: dict, lora: dict | None = None) -> dict:
        import deepspeed
        import torch
        import openrlhf.utils.utils as openrlhf_utils
        from openrlhf.trainer.ray import ppo_actor

        from fastsync_openrlhf.trainer import install_trainer
        from fastsync_rigs.openrlhf_cpu import openrlhf_args

        if self.trainer is not None and getattr(self.trainer, "_fastsync_sync", None) is not None:
            self.trainer._fastsync_sync.close()  # the previous cell's session
        self.trainer = self.engine = self.opt = None
        install_trainer(openrlhf_args(fastsync=opts))  # FastSyncPolicyModel.init_model_from_pretrained
        config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                  "zero_optimization": {"stage": 3, "stage3_allgather_sequential": True},  # see the rig
                  "zero_allow_untested_optimizer": True}
        # STAND-IN: OpenRLHF's Actor takes --ds.param_dtype bf16/fp16 only; the matrix compares fp32
        # bytes and greedy tokens against an fp32 engine, as the dense cells do
        to_dtype = openrlhf_utils.convert_to_torch_dtype
        openrlhf_utils.convert_to_torch_dtype = lambda _dtype: torch.float32
        try:  # ppo_actor.Actor: OpenRLHF's, or with --fastsync.moe the adapter's swap after it
            actor = ppo_actor.Actor(model_dir, attn_implementation="sdpa", param_dtype="bf16", ds_config=config,
                                    **(lora or {}))
        finally:
            openrlhf_utils.convert_to_torch_dtype = to_dtype
        partitioned = all(hasattr(p, "ds_id") for p in actor.model.parameters())
        trained = [p for p in actor.model.parameters() if p.requires_grad]  # with LoRA: the adapters only
        self.engine, self.opt, _, _ = deepspeed.initialize(
            model=actor.model, optimizer=torch.optim.AdamW(trained, lr=0.02), config=config)
        self.model_dir = model_dir
        from fastsync.moe.block import FastSyncMoEBlock

        blocks = {n: "fastsync" if isinstance(m, FastSyncMoEBlock) else type(m).__name__
                  for n, m in self.engine.module.named_modules() if n.endswith(".mlp")}
        return {"swapped": sorted(getattr(actor, "fastsync_moe_swapped", None) or {}), "blocks": blocks,
                "partitioned": partitioned}

    return build_actor


@pytest.fixture(scope="module")
def moe_rig(tmp_path_factory):
    """One vLLM CPU engine serving the MoE checkpoint and two ZeRO-3 trainer ranks: when the dense
    rig is up, an engine in its Ray (its one logical GPU and its CPUs are held by the dense actors:
    this one holds none) and the dense rig's trainer ranks, whose torch.distributed world serves any model
    (each cell builds its policy from the MoE checkpoint with ``_actor_build``, as the LoRA cell does
    from the dense one); else a rig of their own."""
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
    build, _, full_weights, planned = _calls()
    ray, version = m.ray, 10 * (1 + [p.values[0] for p in MOE_CELLS].index(moe))
    built = ray.get([t.__ray_call__.remote(_actor_build(), m.model_dir, opts) for t in m.trainers], timeout=300)
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


def _lora_reference():
    """The trainer-rank call (by value, see :func:`_calls`) that gathers the PEFT policy (collective)
    and, on rank 0, returns its greedy tokens (PEFT's own forward, adapters unmerged) and
    ``merge_and_unload()``'s weights."""

    def reference(self, lora: dict, prompts: list, max_tokens: int):
        import deepspeed
        import peft
        import torch
        import transformers

        from fastsync_rigs.openrlhf_cpu import hf_greedy

        params = list(self.engine.module.named_parameters())
        with deepspeed.zero.GatheredParameters([p for _, p in params]):
            full = {n: p.data.clone() for n, p in params} if self.rank == 0 else None
        if self.rank != 0:
            return None
        base = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(self.model_dir),
                                                             dtype=torch.float32)
        config = peft.LoraConfig(task_type="CAUSAL_LM", r=lora["lora_rank"], lora_alpha=lora["lora_alpha"],
                                 target_modules=lora["target_modules"], lora_dropout=0.0, bias="none")
        ref = peft.get_peft_model(base, config)
        ref.load_state_dict(full, strict=True)
        tokens = hf_greedy(ref.eval(), prompts, max_tokens)
        merged = {n: t.clone() for n, t in ref.merge_and_unload().state_dict().items()}
        lora_b = [t for n, t in full.items() if ".lora_B." in n]
        return {"tokens": tokens, "merged": merged, "lora_b_zero": all(bool((t == 0).all()) for t in lora_b),
                "num_lora_b": len(lora_b)}

    return reference


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
    build, _, _, _ = _calls()
    ray, version = rig.ray, 10 * (len(CELLS) + 1)  # after every dense cell's block on these engines
    ray.get([t.close.remote() for t in rig.trainers], timeout=60)  # the previous cell's session
    ray.get([t.__ray_call__.remote(_actor_build(), rig.model_dir, opts, LORA) for t in rig.trainers], timeout=300)
    ray.get([t.make_trainer.remote(rig.engines, opts) for t in rig.trainers], timeout=120)
    ray.get([t.__ray_call__.remote(build, version - 1) for t in rig.trainers], timeout=300)
    for step in range(2):
        rig.train_step(seed=version + step)  # a real ZeRO-3 AdamW step of the adapters (the base is frozen)
        ref = ray.get([t.__ray_call__.remote(_lora_reference(), LORA, PROMPTS, MAX_TOKENS)
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
