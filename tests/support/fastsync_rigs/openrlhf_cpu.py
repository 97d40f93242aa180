"""OpenRLHF's sync path on a CPU host, with real parts: Ray with logical GPUs, OpenRLHF's own
``RolloutRayActor`` (fastsync's subclass) running the real vLLM CPU engine, and DeepSpeed ZeRO-3
trainer ranks over gloo as Ray actors. Used by the adapter's tests, ``examples/openrlhf/bench.py``
and the CPU example. Only the set-up OpenRLHF does with CUDA is done here instead: ``DeepspeedStrategy``'s
``setup_distributed`` (``torch.cuda.set_device``, a ``"cuda"`` device mesh) becomes
``deepspeed.init_distributed("gloo")``, and ``ActorPPOTrainer.__init__`` (CUDA syncs, loss and
replay-buffer set-up) is replaced by setting the attributes ``broadcast_to_vllm`` reads.

Example::

    rig = CpuRig(model_dir, tmp_dir, num_trainers=2)     # Ray, one engine, N DeepSpeed ranks
    rig.broadcast_to_vllm()                              # the adapter's method, on every rank
    assert rig.engine_tokens(PROMPTS) == rig.trainer_tokens(PROMPTS)
    rig.train_step(seed=1); rig.broadcast_to_vllm()      # next version
    rig.close()
"""

from __future__ import annotations

import json
import os
import sys
import socket
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

__all__ = ["CpuRig", "TrainerRank", "release", "build_checkpoint", "worker_pythonpath", "AWKWARD_QWEN3", "PROMPTS", "hf_greedy",
           "postprocess_s"]

#: Tiny Qwen3 with awkward sizes: hidden 200 and intermediate 344 (not multiples of 64), odd
#: element counts in the norms (so ZeRO-3's last partition is padded), head_dim 64 (vLLM's CPU
#: attention takes 32/64/...), vocab 512 (vLLM pads others to 64 on CPU).
AWKWARD_QWEN3: dict[str, Any] = {
    "vocab_size": 512, "hidden_size": 200, "intermediate_size": 344, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "initializer_range": 0.2, "bos_token_id": 1,
    "eos_token_id": 2,
}
PROMPTS: list[list[int]] = [[5, 6, 7, 8], [100, 200, 300], [11, 42, 99, 7, 123], [400, 3, 77]]
MAX_TOKENS = 6


def build_checkpoint(out_dir: str | os.PathLike, config: dict | None = None, *, seed: int = 0,
                     dtype: str = "float32") -> str:
    """A random-weight Qwen3 ``save_pretrained`` checkpoint (reused when already there)."""
    import torch
    import transformers

    cfg = dict(AWKWARD_QWEN3 if config is None else config)
    out = Path(out_dir)
    stamp = out / "fastsync_openrlhf_tiny.json"
    want = {"config": cfg, "seed": seed, "dtype": dtype}
    if stamp.exists() and json.loads(stamp.read_text()) == want:
        return str(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**cfg)).to(getattr(torch, dtype))
    model.save_pretrained(out)
    stamp.write_text(json.dumps(want, sort_keys=True))
    return str(out)


def hf_greedy(model: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy continuation by an HF causal LM (full forward per token)."""
    import torch

    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            for _ in range(max_tokens):
                nxt = model(input_ids=ids).logits[0, -1].argmax().view(1, 1)
                ids = torch.cat([ids, nxt], dim=1)
            out.append(ids[0, len(p):].tolist())
    return out


def worker_pythonpath(extra: str = "") -> str:
    """PYTHONPATH for the Ray workers: ``extra`` first (e.g. a flash_attn stand-in), then where
    this process found fastsync, this adapter and these rigs, then the inherited PYTHONPATH."""
    import fastsync
    import fastsync_openrlhf

    parts = [extra, str(Path(fastsync.__file__).parent.parent), str(Path(fastsync_openrlhf.__file__).parent.parent),
             str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH", "")]
    return os.pathsep.join(p for p in parts if p)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def openrlhf_args(*, zero_stage: int = 3, fastsync: dict | None = None) -> SimpleNamespace:
    """The part of OpenRLHF's hierarchized ``args`` that ``broadcast_to_vllm`` reads."""
    fs = {"enable": True, "transport": "nixl", "timeout_s": 120.0, "control_host": "127.0.0.1", "verify": False,
          "moe": "off", **(fastsync or {})}
    return SimpleNamespace(
        vllm=SimpleNamespace(enable_prefix_caching=False, sync_backend="gloo", sync_with_ray=False, num_engines=1,
                             tensor_parallel_size=1),
        ds=SimpleNamespace(zero_stage=zero_stage, tensor_parallel_size=1, lora=SimpleNamespace(rank=0)),
        train=SimpleNamespace(colocate_all=False, async_enable=False),
        fastsync=SimpleNamespace(**fs),
    )


class TrainerRank:
    """One DeepSpeed ZeRO-3 rank (a Ray actor; see :class:`CpuRig`)."""

    def __init__(self, rank: int, world_size: int, port: int, model_dir: str) -> None:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port), DS_ACCELERATOR="cpu", GLOO_SOCKET_IFNAME="lo")
        import deepspeed
        import torch
        import transformers

        torch.set_num_threads(1)
        # DeepSpeed on CPU JIT-compiles its shared-memory all-reduce op here (45-300 s on 2 cores, again
        # for every venv path, and a run killed mid-build leaves a lock that hangs the next one);
        # only inference_all_reduce uses it, not ZeRO-3 training over gloo: not built
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        deepspeed.init_distributed(dist_backend="gloo")  # OpenRLHF's setup_distributed, minus CUDA
        self.rank, self.world_size, self.model_dir = rank, world_size, model_dir
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        opt = torch.optim.AdamW(model.parameters(), lr=0.02)
        config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                  # sequential gathers: DeepSpeed 0.19.6's coalesced all_gather waits only on the last
                  # async handle, and gloo can finish them out of order (a gathered parameter read
                  # before its bytes landed; see tests/adapters/openrlhf_moe_job.py). NCCL is unaffected.
                  "zero_optimization": {"stage": 3, "stage3_allgather_sequential": True},
                  "zero_allow_untested_optimizer": True}
        self.engine, self.opt, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=config)
        self.trainer: Any = None

    def train_step(self, seed: int) -> float:
        """A real DeepSpeed ZeRO-3 step (AdamW) on random tokens: every weight moves."""
        import torch

        g = torch.Generator().manual_seed(seed)
        vocab = self.engine.module.config.vocab_size
        batch = torch.randint(3, vocab, (2, 16), generator=g)
        loss = self.engine(input_ids=batch, labels=batch).loss
        self.engine.backward(loss)
        self.engine.step()
        return float(loss.item())

    # ---- the adapter's broadcast_to_vllm, as OpenRLHF's PolicyModelActor calls it ----------
    def make_trainer(self, engines: list, fastsync: dict | None = None) -> dict:
        """``install_trainer`` (what ``FastSyncPolicyModelActor`` runs in its worker), then the
        trainer class OpenRLHF's module now names, with the attributes its ``__init__`` sets."""
        from openrlhf.trainer.ray import ppo_actor

        from fastsync_openrlhf.trainer import install_trainer

        args = openrlhf_args(fastsync=fastsync)
        install_trainer(args)
        cls = ppo_actor.ActorPPOTrainer
        t = cls.__new__(cls)  # stand-in for ActorPPOTrainer.__init__ (CUDA): the attributes it sets
        t.strategy, t.args = SimpleNamespace(args=args), args
        t.actor = SimpleNamespace(model=self.engine, is_vlm=False)  # OpenRLHF: actor.model is the DeepSpeedEngine
        t.vllm_engines = engines
        t.use_cuda_ipc = False
        if self.rank == 0:
            t._init_vllm_sync_group(args.vllm.sync_backend)  # OpenRLHF's __init__ calls it on rank 0
        self.trainer = t
        return {"pid": os.getpid(), "ActorPPOTrainer": f"{cls.__module__}.{cls.__qualname__}"}

    def broadcast_to_vllm(self) -> dict:
        t0 = time.perf_counter()
        res = self.trainer.broadcast_to_vllm()
        stalls = [w.get("stall_s", 0.0) for replies in res.engines for w in replies]  # rank 0 drives the engines
        return {"rank": self.rank, "seconds": time.perf_counter() - t0, "version": res.version,
                "sync_s": res.seconds, "engine_stall_seconds": max(stalls) if stalls else None}

    def trainer_tokens(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]] | None:
        """The trainer model's own greedy tokens (rank 0; the gather is collective)."""
        import deepspeed
        import torch
        import transformers

        full = {}
        params = list(self.engine.module.named_parameters())
        with deepspeed.zero.GatheredParameters([p for _, p in params]):
            if self.rank == 0:
                full = {n: p.data.clone() for n, p in params}
        if self.rank != 0:
            return None
        config = transformers.AutoConfig.from_pretrained(self.model_dir)
        ref = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        ref.load_state_dict(full, strict=True)
        return hf_greedy(ref.eval(), prompts, max_tokens)

    def close(self) -> None:
        for obj in (getattr(self, "sync", None), getattr(self, "pattern", None),
                    getattr(getattr(self, "trainer", None), "_fastsync_sync", None)):
            if obj is not None:
                obj.close()


def postprocess_s(result: Any) -> float:
    """The longest engine-side post-load step (vLLM CPU's weight repack at the flip) of a
    SyncResult; 0 on ranks that do not drive the engines."""
    engines = getattr(result, "engines", None) or []
    return max((float(w.get("postprocess_s", 0.0)) for e in engines for w in e if isinstance(w, dict)), default=0.0)


def release(ray: Any, trainers: list, engine: Any) -> None:
    """Close the trainer ranks' fastsync ends and the engine's receiver, each bounded, whatever
    failed (shutting down regardless)."""
    try:
        ray.get([t.close.remote() for t in trainers], timeout=60)
    except Exception:  # noqa: BLE001
        pass
    try:
        ray.get(engine.fastsync_close.remote(), timeout=30)
    except Exception:  # noqa: BLE001
        pass


class CpuRig:
    """Ray (logical GPUs) + one ``FastSyncRolloutRayActor`` with the vLLM CPU engine + N DeepSpeed
    ZeRO-3 ranks. ``env`` reaches every Ray worker (e.g. PYTHONPATH with a flash_attn stand-in)."""

    def __init__(self, model_dir: str, tmp_dir: str, *, num_trainers: int = 2, dtype: str = "float32",
                 env: dict[str, str] | None = None, start_timeout_s: float = 300.0, hosts: Any = None,
                 rank_cls: type = TrainerRank) -> None:
        """``hosts``: a ``fastsync.bench.netns_cluster.HostRig`` of 2 hosts: a real two-node Ray cluster,
        the trainer ranks (and this driver) on host 0, the engine on host 1, the control store on
        host 0's address. ``rank_cls``: the trainer ranks' class (a benchmark's subclass)."""
        import ray

        from fastsync_openrlhf.rollout import OPENRLHF_EXTENSION, FastSyncRolloutRayActor

        self.model_dir = model_dir
        env_vars = {"PYTHONPATH": worker_pythonpath((env or {}).get("PYTHONPATH", "")), "OMP_NUM_THREADS": "1",
                    "RAY_AUTH_MODE": "disabled", "GLOO_SOCKET_IFNAME": "lo", "DS_ACCELERATOR": "cpu",
                    "TOKENIZERS_PARALLELISM": "false",
                    **{k: v for k, v in (env or {}).items() if k != "PYTHONPATH"}}
        self._saved_auth = os.environ.get("RAY_AUTH_MODE")
        os.environ["RAY_AUTH_MODE"] = "disabled"  # else Ray writes a token into the home folder
        self.control_host = "127.0.0.1"
        place = [{}, {}]
        if hosts is not None:  # each node's NIC settings come from its host's environment
            address = hosts.start_ray(tmp_dir, num_cpus=num_trainers + 2, num_gpus=1,
                                      env={**env_vars, "PYTHONPATH": os.pathsep.join([env_vars["PYTHONPATH"], *sys.path])})
            hosts.enter_for_good(0)  # the driver lives on the trainer node
            ray.init(address=address, log_to_driver=bool(os.environ.get("FASTSYNC_RIG_LOGS")),
                     runtime_env={"env_vars": env_vars})
            self.control_host = hosts.addr(0)
            place = [{"resources": {"fs_host0": 1}}, {"resources": {"fs_host1": 1}}]
        else:
            ray.init(address="local", num_cpus=num_trainers + 2, num_gpus=1, include_dashboard=False,
                     log_to_driver=bool(os.environ.get("FASTSYNC_RIG_LOGS")), _temp_dir=tmp_dir,
                     runtime_env={"env_vars": env_vars})
        self.ray = ray
        t0 = time.perf_counter()
        # the kwargs OpenRLHF's create_vllm_engines passes, with CPU-sized memory and the test's dtype
        self.engine = FastSyncRolloutRayActor.options(num_cpus=1, num_gpus=1, **place[1]).remote(
            model=model_dir, enforce_eager=True, worker_extension_cls=OPENRLHF_EXTENSION, tensor_parallel_size=1,
            seed=0, distributed_executor_backend="uni", max_model_len=256, enable_prefix_caching=False, dtype=dtype,
            trust_remote_code=True, full_determinism=False, bundle_indices=None, num_gpus=1,
            enable_sleep_mode=False, skip_tokenizer_init=True, kv_cache_memory_bytes=64 << 20)
        port = _free_port()
        actor = ray.remote(num_cpus=1)(rank_cls).options(**place[0])
        self.trainers = [actor.remote(r, num_trainers, port, model_dir) for r in range(num_trainers)]
        ray.get(self.engine.get_num_unfinished_requests.remote(), timeout=start_timeout_s)
        ray.get([t.__ray_ready__.remote() for t in self.trainers], timeout=start_timeout_s)
        self.start_s = time.perf_counter() - t0

    def _all(self, method: str, *args: Any, timeout_s: float = 300.0) -> list:
        return self.ray.get([getattr(t, method).remote(*args) for t in self.trainers], timeout=timeout_s)

    def make_trainers(self, fastsync: dict | None = None) -> list[dict]:
        return self._all("make_trainer", [self.engine], {"control_host": self.control_host, **(fastsync or {})})

    def broadcast_to_vllm(self) -> list[dict]:
        return self._all("broadcast_to_vllm")

    def train_step(self, seed: int) -> list[float]:
        return self._all("train_step", seed)

    def trainer_tokens(self, prompts: list[list[int]] = PROMPTS, max_tokens: int = MAX_TOKENS) -> list[list[int]]:
        return self._all("trainer_tokens", prompts, max_tokens)[0]

    def engine_tokens(self, prompts: list[list[int]] = PROMPTS, max_tokens: int = MAX_TOKENS) -> list[list[int]]:
        from vllm import SamplingParams

        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        # one prompt at a time, as the HF reference runs: concurrent requests would be batched
        # by timing, and other batch shapes change the kernels' float rounding (greedy near-ties)
        outs = [self.ray.get(self.engine.generate.remote(p, sp), timeout=120) for p in prompts]
        return [list(o.outputs[0].token_ids) for o in outs]

    def engine_report(self) -> dict:
        return self.ray.get(self.engine.fastsync_openrlhf_report.remote(), timeout=60)

    def engine_version(self) -> list[int]:
        return self.ray.get(self.engine.fastsync_version.remote(), timeout=60)

    def close(self) -> None:
        release(self.ray, self.trainers, self.engine)
        self.ray.shutdown()
        if self._saved_auth is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = self._saved_auth
