"""CPU smoke: verl's FSDP2 shards -> fastsync in-place writes -> the live weights of verl's own
vLLM server (``vLLMHttpServer`` / AsyncLLM on the real vLLM CPU engine), driven by verl's
``CheckpointEngineManager.update_weights`` with ``checkpoint_engine.backend=fastsync``.

    python examples/verl/sync_smoke.py [--preset tiny-qwen3 | --model DIR] [--moe-swap] [--lora R]
                                       [--syncs 2] [--verify full] [--hosts 2] [--json]

``--lora R``: the trainer is a PEFT LoRA actor (rank R on every projection) under verl's
``actor_rollout_ref.model.lora.merge=True``; each rank merges the adapter into its own shards
(``fastsync_verl.lora_merge``), the reference tokens are the PEFT model's own.

``--model DIR``: your own Hugging Face checkpoint (config.json + safetensors; dense or MoE) instead
of a preset, to see before a run whether fastsync syncs it in place (the JSON's ``inplace``,
``fallback`` and ``bytes_equal``). ``--moe-swap``: the trainer swaps its MoE blocks for fastsync's
(what ``actor_rollout_ref.model.external_lib=fastsync_verl.moe`` does in verl's FSDP engine).

``--hosts 2``: a real two-node Ray cluster on hosts made of network namespaces on this machine
(``fastsync.bench.netns_cluster``; root / CAP_NET_ADMIN): the trainer actors on one node, verl's vLLM
server and rollout workers on the other, NIXL held to TCP over the hosts' NICs
(``--nic-gbps``), the control store on the trainer node's address.
``--hosts 3 --tp 2``: the trainers on host 0 and ONE vLLM replica across hosts 1 and 2 (verl's
multi-node replica: a ``vLLMHttpServer`` per node, node rank 0 runs AsyncLLM, node rank 1 runs
vLLM headless; TP rank r on host 1 + r), taking the in-place path: the leader drives both engine
workers through vLLM's multi-node executor, every trainer rank writes into both hosts' live
weights. In general ``--hosts H`` puts the replica on H - 1 hosts, which must divide ``--tp``.

What is verl's here and what is a stand-in (honestly):
* rollout: verl's ``vLLMHttpServer`` as a named Ray actor (created as verl's ``vLLMReplica``
  does) running ``vllm serve`` in-process (AsyncLLM, uvicorn) with
  ``engine_kwargs.vllm.worker_extension_cls=fastsync_verl.extension.FastSyncVerlWorkerExtension``;
  verl's ``CheckpointEngineWorker`` beside it builds verl's own vLLM ``ServerAdapter``.
  Stand-in: the replica object the manager holds (verl's ``vLLMReplica`` needs GPU worker
  groups); its ``abort_all_requests`` / KV-cache calls are no-ops because verl 0.9.1's
  ``abort_all_requests`` raises on vLLM 0.32 (``pause_generation`` lost
  ``wait_for_inflight_requests``): fastsync's update pauses AsyncLLM itself
  (``fastsync_verl/server.py``).
* trainer: 2 Ray actors hold the model sharded with FSDP2 (gloo), take AdamW steps and run
  verl's own ``FSDPEngine.get_per_tensor_param`` (wrapped by ``fastsync_verl.shards``); the
  object passed as verl's engine is a stand-in with only the attributes that method reads
  (verl's full actor worker needs its GPU bootstrap). ``full_tensor()`` is counted while
  ``send_weights`` runs and must stay 0. The trainer worker group is a stand-in dispatching
  what the manager calls (``execute_checkpoint_engine``, ``update_weights``).

Prints ``bytes_equal`` (after every in-place sync, a SHA-256 of every engine tensor of every
engine rank equals the same tensor built from the trainer's gathered weights by the plan's
reference, the copies recorded from vLLM's own loader), ``verify`` (``engine_kwargs.fastsync.verify``:
the engine ranks checked the trainers' digests before every flip), ``fallback`` (tensors and
bytes vLLM's ``load_weights`` took instead), ``match`` (after every sync the server's greedy tokens
equal the trainer model's own),
``inplace`` (the session took the in-place path: the writes landed in the live engine tensors),
``trainer_full_tensor_calls`` (0), the version verl's server records, and the generation stall.
verl's CPU gaps are bridged by the test rig ``tests/support/fastsync_rigs/verl_cpu.py`` (dist-info
shim, CPU platform, tokenizer), not in the wheel.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time

#: verl's CPU bridges (``fastsync_rigs.verl_cpu``), for this process and, through PYTHONPATH, Ray's workers
SUPPORT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tests", "support"))
if SUPPORT not in sys.path:
    sys.path.insert(0, SUPPORT)
if SUPPORT not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (SUPPORT, os.environ.get("PYTHONPATH")) if p)

#: engine_kwargs.fastsync: refuse the fallbacks, so a run that did not go in place fails by name
KWARGS = {"trainer_shards": "on", "inplace": "on"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Trainer:
    """One FSDP2 trainer rank with the fastsync backend, as verl's actor worker holds it."""

    def __init__(self, rank: int, world: int, gloo_port: int, model_dir: str, timeout_s: float,
                 kwargs: dict, control_host: str = "127.0.0.1", moe_swap: bool = False, lora: int = 0) -> None:
        import types

        import torch
        import torch.distributed as dist
        import transformers
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import DTensor
        from verl.checkpoint_engine import CheckpointEngineRegistry
        from verl.utils.import_utils import import_external_libs

        from fastsync_rigs.verl_cpu import use_cpu_platform

        use_cpu_platform()
        from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

        torch.set_num_threads(1)
        import_external_libs("fastsync_verl")  # what checkpoint_engine.custom_backend_module does
        self.calls = {"n": 0}
        orig = DTensor.full_tensor

        def counted(t, *a, **kw):
            self.calls["n"] += 1
            return orig(t, *a, **kw)

        DTensor.full_tensor = counted
        self.rank, self.model_dir, self.FSDPEngine = rank, model_dir, FSDPEngine
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{gloo_port}", rank=rank, world_size=world)
        self.model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        self.swapped = 0
        if moe_swap:  # what fastsync_verl.moe does after verl's _build_module: before FSDP wraps the module
            from fastsync import patch_moe

            self.swapped = len(patch_moe(self.model, ep_group=None, backend="auto"))
        self.lora = lora
        if lora:  # a PEFT LoRA actor (verl's lora.merge=True): every projection, B random so the merge shows
            self.model = _peft(self.model, lora)
        mesh = init_device_mesh("cpu", (world,))
        for layer in (self.model.base_model.model.model.layers if lora else self.model.model.layers):
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=0.02)
        self.engine = CheckpointEngineRegistry.new("fastsync", is_master=rank == 0, bucket_size=1 << 20,
                                                   control_host=control_host, timeout_s=timeout_s, **kwargs)
        self.fake = types.SimpleNamespace(  # stand-in for verl's FSDPEngine: what get_per_tensor_param reads
            # (LoRA: True skips verl's whole-module staging onto a GPU, load_fsdp_model_to_gpu; none here)
            module=self.model, _uses_fsdp2_cpu_offload_policy=bool(lora), _is_offload_param=False, _qat_enabled=False,
            model_config=types.SimpleNamespace(lora={"merge": True} if lora else {}, hf_config=self.model.config))
        if lora:  # verl's own merged export, lazy (it merges and gathers only when iterated)
            self.fake._merged_lora_per_tensor_param = types.MethodType(FSDPEngine._merged_lora_per_tensor_param,
                                                                      self.fake)
        self.full_tensor_calls = 0
        self.iterated = False

    def execute_checkpoint_engine(self, method: str, *args, **kwargs):
        return getattr(self.engine, method)(*args, **kwargs)

    def train_step(self, seed: int) -> float:
        from fastsync.demo.run import _train_step

        return _train_step(self.model, self.opt, self.model.config.vocab_size, seed=seed)

    def send(self, global_steps: int) -> dict:
        import asyncio

        before = self.calls["n"]
        weights, _ = self.FSDPEngine.get_per_tensor_param(self.fake)  # verl's own export, lazy
        metrics = asyncio.run(self.engine.send_weights(weights, global_steps=global_steps))
        self.full_tensor_calls += self.calls["n"] - before
        self.iterated = self.iterated or bool(getattr(weights, "iterated", True))
        return metrics

    def reference(self, prompts: list[list[int]], max_tokens: int) -> list[list[int]] | None:
        from fastsync.demo.run import _full_state, _reference, hf_greedy

        full = _full_state(self.model)  # a collective: every rank calls it (not part of the sync)
        if self.lora:  # the trainer's PEFT model itself (adapter unmerged, LoRA forward), on rank 0
            return hf_greedy(self._peft_copy(full), prompts, max_tokens) if self.rank == 0 else None
        return _reference(self.model_dir, full, prompts, max_tokens, "float32") if self.rank == 0 else None

    def _peft_copy(self, full: dict):
        """A copy of the trainer's PEFT model holding the gathered ``full`` state (rank 0)."""
        import torch
        import transformers

        config = transformers.AutoConfig.from_pretrained(self.model_dir)  # float32, as the trainer holds it
        base = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        pm = _peft(base, self.lora)
        pm.load_state_dict(full)
        return pm.eval()

    def counts(self) -> dict:
        return {"full_tensor_calls": self.full_tensor_calls, "iterated": self.iterated,
                "engine": self.engine.describe(), "moe_blocks_swapped": self.swapped}

    def reference_digests(self) -> dict | None:
        """Trainer rank 0 (every rank calls it: a collective): per engine rank of the in-place
        session, a SHA-256 (16 hex digits) of each engine tensor built from this step's gathered
        weights by the plan's reference copies, and what vLLM's ``load_weights`` took instead."""
        from fastsync.bench.local import reference_digests
        from fastsync.demo.run import _full_state

        full = _full_state(self.model)
        if self.lora and self.rank == 0:  # the weights the engine should hold: PEFT's own merge
            full = self._peft_copy(full).merge_and_unload().state_dict()
        end = getattr(self.engine, "_end", None)
        inplace = getattr(end, "inplace", None)
        if self.rank != 0 or inplace is None:
            return None
        out = {int(w["rank"]): reference_digests(full, w["tensors"]) for e in inplace.ws.engine_info for w in e}
        return {"tensors": out, "version": inplace.ws.version, "fallback": inplace.last_fallback}


def _peft(model, r: int):
    """``model`` under PEFT LoRA rank ``r`` on q/k/v/o and gate/up/down (alpha 2r), B random and
    nonzero (seeded: every rank the same; a fresh adapter's B = 0 would hide a wrong merge)."""
    import torch
    from peft import LoraConfig, get_peft_model

    pm = get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, target_modules=[
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    g = torch.Generator().manual_seed(r)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if ".lora_B." in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return pm


class TrainerGroup:
    """Stand-in for verl's actor RayWorkerGroup: DP_COMPUTE dispatch of what the manager calls."""

    def __init__(self, actors: list) -> None:
        self.actors, self.world_size = actors, len(actors)

    def execute_checkpoint_engine(self, method: list[str], **kwargs: list) -> list:
        return [a.execute_checkpoint_engine.remote(method[i], **{k: v[i] for k, v in kwargs.items()})
                for i, a in enumerate(self.actors)]

    def update_weights(self, global_steps: int | None = None, mode: str = "") -> list:
        return [a.send.remote(global_steps) for a in self.actors]


def rollout_worker_cls():
    from verl.checkpoint_engine.base import CheckpointEngineWorker

    class RolloutWorker(CheckpointEngineWorker):
        """verl's CheckpointEngineWorker with verl's own vLLM ServerAdapter (server_adapter=None)."""

        def __init__(self, rollout_config, model_config, port: int, rank: int = 0, world: int = 1,
                     local_world: int | None = None, master_addr: str = "127.0.0.1", replica: int = 0) -> None:
            import torch

            torch.set_num_threads(1)
            # what verl's RayWorkerGroup sets: rank 0's node address for the group's gloo rendezvous,
            # ``local_world`` ranks per node (verl's ServerAdapter takes its node rank, and so which
            # node's server it talks to, from RAY_LOCAL_WORLD_SIZE)
            local = world if local_world is None else local_world
            os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), MASTER_ADDR=master_addr, MASTER_PORT=str(port),
                              RAY_LOCAL_WORLD_SIZE=str(local), LOCAL_RANK=str(rank % local))
            super().__init__(rollout_config, model_config, None, replica_rank=replica)  # finds vllm_server_{replica}_*

        def state(self) -> dict:
            e = self.checkpoint_engine
            return {**e.describe(), "path": e.last_path, "stall_s": e.last_stall_s, "drain_s": e.last_drain_s,
                    "phases": {k: round(v, 4) for k, v in e.last_phases.items()},
                    "paused_by_fastsync": e.last_paused_here,
                    "adapter": f"{type(self.server_adapter).__module__}.{type(self.server_adapter).__name__}"}

    return RolloutWorker


class Replica:
    """Stand-in for verl's vLLMReplica (module doc): its workers, no-op pause/KV calls."""

    def __init__(self, workers: list) -> None:
        self.workers = workers

    async def abort_all_requests(self, reject_request: bool = False) -> None: ...
    async def release_kv_cache(self) -> None: ...
    async def resume_kv_cache(self) -> None: ...
    async def resume_generation(self) -> None: ...


#: the long request in flight at the last sync
LONG_PROMPT, LONG_TOKENS = [9, 10, 11], 500


def _inflight(server, got, old_long: list[int], max_tokens: int, step: int) -> dict:
    """What the long request in flight at the last sync got: how it ended, its version stamps
    (``fastsync_verl.stamps``: ``[[global_steps, first token index], ...]``) and whether its tokens
    are right: those before the flip the old weights' own greedy continuation, those after it
    the new weights' continuation of the prompt and the tokens before (checked on the first
    ``max_tokens`` of them: a fresh request on the new weights)."""
    toks, ex = list(got.token_ids), dict(got.extra_fields)
    spans = ex.get("weight_versions") or []
    out = {"stop_reason": got.stop_reason, "tokens": len(toks), "weight_versions": spans,
           "min_global_steps": ex.get("min_global_steps"), "max_global_steps": ex.get("max_global_steps"),
           "global_steps": ex.get("global_steps")}
    cut = spans[1][1] if len(spans) >= 2 else len(toks)
    out["old_part_matches"] = toks[:cut] == old_long[:cut]
    if len(spans) >= 2:
        n = min(max_tokens, len(toks) - cut)
        fresh = generate(server, [LONG_PROMPT + toks[:cut]], n, f"new{step}")[0]
        out["new_part_matches"] = toks[cut:cut + n] == fresh
    return out


def generate(server, prompts: list[list[int]], max_tokens: int, tag: str) -> list[list[int]]:
    import ray

    refs = [server.generate.remote(prompt_ids=list(p), request_id=f"{tag}-{i}",
                                   sampling_params={"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True})
            for i, p in enumerate(prompts)]
    return [list(r.token_ids) for r in ray.get(refs, timeout=300)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny-qwen3")
    ap.add_argument("--model", default=None, metavar="DIR",
                    help="a Hugging Face checkpoint directory (config.json + safetensors) to sync instead of --preset; "
                         "read only (the smoke works on links to its files)")
    ap.add_argument("--moe-swap", action="store_true",
                    help="the trainer swaps its MoE blocks for fastsync's (fastsync_verl.moe) before FSDP2 wraps it")
    ap.add_argument("--lora", type=int, default=0, metavar="R",
                    help="the trainer is a PEFT LoRA actor (rank R on every projection, B random) with verl's "
                         "actor_rollout_ref.model.lora.merge=True: each rank merges the adapter into its own shards")
    ap.add_argument("--verify", choices=("off", "sample", "full"), default="full",
                    help="engine_kwargs.fastsync.verify: the engine ranks check the trainers' digests before the flip")
    ap.add_argument("--syncs", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--timeout-s", type=float, default=120.0)
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size of verl's vLLM server (engine workers)")
    ap.add_argument("--readd", action="store_true",
                    help="then replace the rollout worker (verl's remove_replicas/add_replicas with a new "
                         "CheckpointEngineWorker for the same server) and sync once more: a fresh session re-plans "
                         "against the live engine")
    ap.add_argument("--hosts", type=int, default=1,
                    help="H >= 2: a Ray node per network-namespace host of this machine, the trainers on host 0, "
                         "verl's vLLM replica across hosts 1..H-1 (H - 1 must divide --tp)")
    ap.add_argument("--nic-gbps", type=float, default=2.0, help="with --hosts: each host's NIC rate")
    ap.add_argument("--pause-mode", choices=("abort", "wait", "keep"), default="abort",
                    help="engine_kwargs.fastsync.pause_mode: what the long request in flight at the last sync "
                         "meets (aborted, finished on the old weights first, or kept across the flip)")
    ap.add_argument("--staged", action="store_true",
                    help="engine_kwargs.fastsync.staged=true: generation goes on while the writes land, the "
                         "pause is only the flip")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    a.kwargs = {**KWARGS, "pause_mode": a.pause_mode, "staged": a.staged, "verify": a.verify}
    if a.model is not None and not os.path.isfile(os.path.join(a.model, "config.json")):
        print(f"--model {a.model!r}: no config.json there (a Hugging Face checkpoint directory is needed)",
              file=sys.stderr)
        return 2
    if a.model is not None:  # what vLLM-CPU cannot start, said before Ray and the engine start
        from fastsync import ConfigError
        from fastsync.engines.vllm.cpu_limits import check_cpu_engine

        try:
            with open(os.path.join(a.model, "config.json")) as f:
                check_cpu_engine(json.load(f), f"--model {a.model}")
        except ConfigError as e:
            print(e, file=sys.stderr)
            return 2
    trainers_n = 2
    why = _check_hosts(a.hosts, a.tp)
    if why is not None:  # before anything starts
        print(why, file=sys.stderr)
        return 2
    rig = None
    if a.hosts >= 2:
        from fastsync.bench.netns import rig_unavailable
        from fastsync.bench.netns_cluster import HostRig, check_shape

        why = rig_unavailable()
        if why is not None:
            print(f"--hosts {a.hosts}: {why}", file=sys.stderr)
            return 2
        check_shape(a.hosts, a.nic_gbps)
        rig = HostRig(a.hosts, a.nic_gbps)
    try:
        return _main(a, trainers_n, rig)
    finally:
        if rig is not None:
            rig.close()


def _check_hosts(hosts: int, tp: int) -> str | None:
    """Why ``--hosts`` / ``--tp`` cannot be laid out (naming the flags), or None."""
    if tp < 1:
        return f"--tp must be >= 1, got {tp}"
    if hosts < 1:
        return f"--hosts must be >= 1, got {hosts}"
    if hosts >= 2 and tp % (hosts - 1):
        return (f"--hosts {hosts} puts verl's vLLM replica on {hosts - 1} host(s) (host 0 holds the trainers), "
                f"which must divide --tp {tp}: each host takes the same number of engine workers")
    return None


def _main(a, trainers_n: int, rig) -> int:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ["RAY_AUTH_MODE"] = "disabled"  # else Ray writes a token into the home folder
    work = tempfile.mkdtemp(prefix="fsverl-smoke-")
    import logging

    logging.disable(logging.WARNING)  # --json: stdout carries only the report
    from fastsync_rigs.verl_cpu import vllm_dist_shim, write_word_tokenizer

    vllm_dist_shim(os.path.join(work, "dist"))  # before anything imports verl's vLLM modules
    import ray
    import transformers

    from fastsync.demo.checkpoints import build_tiny_checkpoint
    from fastsync.demo.run import prompts_for
    from fastsync_verl.extension import EXTENSION_PATH

    if a.model is None:
        model_dir = str(build_tiny_checkpoint(a.preset, os.path.join(work, a.preset), dtype="float32"))
    else:  # the user's checkpoint, read only: links to its files in a work folder
        model_dir = os.path.join(work, "model")
        os.makedirs(model_dir)
        src = os.path.abspath(a.model)
        for f in os.listdir(src):
            os.symlink(os.path.join(src, f), os.path.join(model_dir, f))
    if not any(os.path.exists(os.path.join(model_dir, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        write_word_tokenizer(model_dir, transformers.AutoConfig.from_pretrained(model_dir).vocab_size)
    env = {"OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled", "VERL_PLATFORM": "cpu", "GLOO_SOCKET_IFNAME": "lo",
           "PYTHONPATH": os.environ.get("PYTHONPATH", ""), "TOKENIZERS_PARALLELISM": "false",
           "VLLM_CPU_OMP_THREADS_BIND": "nobind"}  # vLLM's auto-binding asserts on a single-NUMA host
    ray_tmp = tempfile.mkdtemp(prefix="fsr", dir="/tmp")  # AF_UNIX socket paths under it must stay < 108 bytes
    setup_hook = {"worker_process_setup_hook": "fastsync_rigs.verl_cpu.use_cpu_platform"}
    if rig is not None:  # each node's NIC, UCX and gloo settings come from its host's environment
        env.pop("GLOO_SOCKET_IFNAME")
        address = rig.start_ray(ray_tmp, num_cpus=2, env={**env, "PYTHONPATH": os.pathsep.join(sys.path)})
        rig.enter_for_good(0)  # the driver lives on the trainer node
        ray.init(address=address, log_to_driver=not a.json, runtime_env={"env_vars": env, **setup_hook})
    else:
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=not a.json,
                 _temp_dir=ray_tmp, runtime_env={"env_vars": env, **setup_hook})
    a.place = (lambda h: {"resources": {f"fs_host{h}": 1}}) if rig is not None else (lambda h: {})
    a.control_host = rig.addr(0) if rig is not None else "127.0.0.1"
    result: dict = {}
    a.addr = rig.addr if rig is not None else (lambda h: "127.0.0.1")
    a.nic = (lambda: [rig.nic_bytes(h) for h in range(a.hosts)]) if rig is not None else (lambda: [])
    nic = [rig.nic_bytes(h) for h in range(a.hosts)] if rig is not None else []
    try:
        result = run(a, model_dir, prompts_for(model_dir), EXTENSION_PATH, trainers_n)
        if rig is not None:  # what left the trainer node through its NIC (the weights, and Ray's traffic)
            result["trainer_host_nic_tx_bytes"] = rig.nic_bytes(0)[0] - nic[0][0]
            # what reached each engine host (its share of the weights, and Ray's and vLLM's traffic)
            result["engine_hosts_nic_rx_bytes"] = [rig.nic_bytes(h)[1] - nic[h][1] for h in range(1, a.hosts)]
            result["model_bytes"] = sum(os.path.getsize(os.path.join(model_dir, f)) for f in os.listdir(model_dir)
                                        if f.endswith(".safetensors"))
    except Exception as e:  # noqa: BLE001 - reported as JSON
        result = {"ok": False, "error": f"{type(e).__name__}: {str(e)[-2000:]}"}
    finally:
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    print(json.dumps(result) if a.json else "\n".join(f"{k}: {v}" for k, v in result.items()))
    readd = result.get("readd")
    ok = result.get("match") and result.get("changed") and result.get("inplace") and result.get("bytes_equal") \
        and result.get("trainer_full_tensor_calls") == 0 \
        and (readd is None or (readd["match"] and readd["changed"] and readd["path"] == "inplace"))
    return 0 if ok else 1


def run(a, model_dir: str, prompts: list[list[int]], extension: str, trainers_n: int) -> dict:
    import ray
    from verl.checkpoint_engine import CheckpointEngineManager
    from verl.workers.config import CheckpointEngineConfig, HFModelConfig, RolloutConfig
    from verl.workers.rollout.replica import RolloutMode
    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer

    ce = CheckpointEngineConfig(backend="fastsync", custom_backend_module="fastsync_verl",
                                update_weights_bucket_megabytes=1,
                                engine_kwargs={"fastsync": {"control_host": a.control_host, "timeout_s": a.timeout_s,
                                                            **a.kwargs}})
    rollout = RolloutConfig(name="vllm", mode="async", tensor_model_parallel_size=a.tp, dtype="float32",
                            enforce_eager=True, max_model_len=512, load_format="auto", free_cache_engine=False,
                            enable_sleep_mode=False, max_num_batched_tokens=512, max_num_seqs=8,
                            skip_tokenizer_init=False, enable_prefix_caching=False, checkpoint_engine=ce,
                            engine_kwargs={"vllm": {"worker_extension_cls": extension,
                                                    "kv_cache_memory_bytes": 64 << 20}})
    # a LoRA actor's config as a user writes it (model.lora.rank / merge): verl's server then starts vLLM
    # without enable_lora, and fastsync's rollout side must take the in-place path for it
    model = HFModelConfig(path=model_dir, lora={"rank": a.lora, "merge": True} if a.lora else {})
    t0 = time.perf_counter()
    # verl's own server class, created as vLLMReplica.launch_servers does: one per node of the replica
    # (named vllm_server_{replica}_{node}), node rank 0 running AsyncLLM, the others vLLM headless
    nnodes = max(1, a.hosts - 1)
    per_node = a.tp // nnodes
    servers = [ray.remote(vLLMHttpServer).options(
        name=f"vllm_server_0_{n}", num_cpus=0, **a.place(1 + n),
        # vLLM finds its own address by a UDP probe of a public resolver, which a host without a route
        # out cannot make: the multi-node executor's message queues would advertise 0.0.0.0
        runtime_env={"env_vars": {"VLLM_HOST_IP": a.addr(1 + n)}} if a.hosts >= 2 else None).remote(
        config=rollout, model_config=model, rollout_mode=RolloutMode.STANDALONE, workers=[], replica_rank=0,
        node_rank=n, gpus_per_node=per_node, nnodes=nnodes,
        cuda_visible_devices=",".join(str(i) for i in range(per_node))) for n in range(nnodes)]
    server = servers[0]
    master = ray.get(server.get_master_address.remote(), timeout=120)
    launched = [s.launch_server.remote(*master) for s in servers]
    gloo = _free_port()
    trainer_cls = ray.remote(num_cpus=0)(Trainer).options(**a.place(0))
    trainers = [trainer_cls.remote(r, trainers_n, gloo, model_dir, a.timeout_s, a.kwargs, a.control_host, a.moe_swap,
                                   a.lora) for r in range(trainers_n)]
    ray.get(launched, timeout=600)
    worker_cls = ray.remote(num_cpus=0)(rollout_worker_cls())
    port = _free_port()  # one rollout worker per engine worker (verl: one per GPU), rank 0 the leader

    def rollout_workers(port: int) -> list:  # rank r beside engine worker r, on node r // per_node
        return [worker_cls.options(**a.place(1 + r // per_node)).remote(rollout, model, port, r, a.tp, per_node,
                                                                         a.addr(1))
                for r in range(a.tp)]

    workers = rollout_workers(port)
    worker = workers[0]
    before = generate(server, prompts, a.max_tokens, "before")
    manager = CheckpointEngineManager(config=ce, actor_wg=TrainerGroup(trainers), replicas=[Replica(workers)])
    start_s = time.perf_counter() - t0
    syncs = []
    for step in range(1, a.syncs + 1):
        ray.get([t.train_step.remote(step) for t in trainers], timeout=300)
        inflight = None
        if step == a.syncs:  # a long request in flight when the update starts (what it meets: --pause-mode)
            old_long = generate(server, [LONG_PROMPT], LONG_TOKENS, f"old{step}")[0]  # the old weights' answer
            inflight = server.generate.remote(prompt_ids=LONG_PROMPT, request_id="inflight",
                                              sampling_params={"temperature": 0.0, "max_tokens": LONG_TOKENS,
                                                               "ignore_eos": True})
            time.sleep(0.05)
        nic0, s0 = a.nic(), time.perf_counter()
        manager.update_weights(global_steps=step)  # verl's own flow: build group, send/receive, finalize
        sync_s, nic1 = time.perf_counter() - s0, a.nic()
        after = generate(server, prompts, a.max_tokens, f"after{step}")
        want = ray.get([t.reference.remote(prompts, a.max_tokens) for t in trainers], timeout=300)[0]
        state = ray.get(worker.state.remote(), timeout=60)
        steps = ray.get(server.__ray_call__.remote(lambda self: self.global_steps), timeout=60)
        bytes_check = _bytes_check(server, trainers) if state["path"] == "inplace" else {}
        syncs.append({"step": step, "match": after == want, "changed": after != before, "sync_s": round(sync_s, 3),
                      **bytes_check,
                      "path": state["path"], "stall_s": round(state["stall_s"], 4), "server_global_steps": steps,
                      "drain_s": round(state["drain_s"], 4), "stall_phases": state["phases"],
                      "rollout_setups": state["setups"], "paused_by_fastsync": state["paused_by_fastsync"],
                      "trainer_setups": [d["setups"] for d in ray.get(
                          [t.execute_checkpoint_engine.remote("describe") for t in trainers], timeout=60)]})
        if nic0:  # --hosts: what each host's NIC carried during this update (tx of host 0, rx of each other)
            syncs[-1]["nic_bytes"] = {"trainer_host_tx": nic1[0][0] - nic0[0][0],
                                      "engine_hosts_rx": [nic1[h][1] - nic0[h][1] for h in range(1, len(nic0))]}
        if inflight is not None:
            got = ray.get(inflight, timeout=300)
            syncs[-1]["inflight"] = _inflight(server, got, old_long, a.max_tokens, step)
        before = after
    adapter = ray.get(worker.state.remote(), timeout=60)["adapter"]
    readd = None
    if a.readd:  # the replica's checkpoint worker is replaced (a restarted replica): new member, new session
        step = a.syncs + 1
        port = _free_port()
        news = rollout_workers(port)
        old_replica = manager.replicas[0]
        manager.remove_replicas([old_replica])
        manager.add_replicas([Replica(news)])
        for w in workers:
            ray.get(w.execute_checkpoint_engine.remote("close"), timeout=60)
            ray.kill(w)
        workers, worker = news, news[0]
        ray.get([t.train_step.remote(step) for t in trainers], timeout=300)
        manager.update_weights(global_steps=step)
        after = generate(server, prompts, a.max_tokens, f"after{step}")
        want = ray.get([t.reference.remote(prompts, a.max_tokens) for t in trainers], timeout=300)[0]
        state = ray.get(worker.state.remote(), timeout=60)
        readd = {"match": after == want, "changed": after != before, "path": state["path"],
                 "rollout_setups": state["setups"],
                 "server_global_steps": ray.get(server.__ray_call__.remote(lambda self: self.global_steps), timeout=60)}
    counts = ray.get([t.counts.remote() for t in trainers], timeout=60)
    if readd is not None:
        readd["trainer_setups"] = [c["engine"]["setups"] for c in counts]
    for h in trainers + workers:
        try:
            ray.get(h.execute_checkpoint_engine.remote("close"), timeout=30)
        except Exception:  # noqa: BLE001
            pass
    stall = round(statistics.median(s["stall_s"] for s in syncs[1:] or syncs), 4)
    return {"bytes_equal": all(s.get("bytes_equal") is True for s in syncs),
            "verify": a.verify, "model": a.model or a.preset, "lora": a.lora, "moe_blocks_swapped": counts[0]["moe_blocks_swapped"],
            "fallback": syncs[-1].get("fallback"),
            "match": all(s["match"] for s in syncs), "changed": all(s["changed"] for s in syncs),
            "inplace": all(s["path"] == "inplace" for s in syncs),
            "trainer_full_tensor_calls": sum(c["full_tensor_calls"] for c in counts),
            "verl_generator_iterated": any(c["iterated"] for c in counts),
            "server_global_steps": syncs[-1]["server_global_steps"],
            "inflight_aborted": syncs[-1].get("inflight", {}).get("stop_reason") == "aborted",
            "inflight": syncs[-1].get("inflight"),
            "sync_s_median": round(statistics.median(s["sync_s"] for s in syncs[1:] or syncs), 4),
            "engine_stall_s": stall,
            "engine_stall_seconds": stall,  # the same figure under the name fastsync demo --json uses
            "stall_ratio": round(statistics.median(s["stall_s"] / s["sync_s"] for s in syncs[1:] or syncs), 3),
            "pause_mode": a.pause_mode, "staged": a.staged,
            "syncs": syncs,
            "rollout_setups": syncs[-1]["rollout_setups"], "trainer_setups": [s["trainer_setups"] for s in syncs][-1],
            "readd": readd,
            "server": "verl.workers.rollout.vllm_rollout.vllm_async_server.vLLMHttpServer", "server_adapter": adapter,
            "extension": extension, "trainers": trainers_n, "tp": a.tp, "preset": a.preset, "start_s": round(start_s, 1),
            "hosts": a.hosts, "nodes": _nodes(trainers, servers, workers)}


def _bytes_check(server, trainers: list) -> dict:
    """Every engine tensor's bytes against the trainer's weights through the plan's reference
    (see the module doc): ``bytes_equal``, the engine tensors compared, the first that differ."""
    import ray

    def digest(self):  # in verl's server actor: the workers' digests through AsyncLLM
        import asyncio

        loop = self.engine.output_handler.get_loop()
        return asyncio.run_coroutine_threadsafe(self.engine.collective_rpc("fastsync_digest"), loop).result(120)

    ref = ray.get([t.reference_digests.remote() for t in trainers], timeout=300)[0]
    got = ray.get(server.__ray_call__.remote(digest), timeout=180)
    bad, n = [], 0
    for d in got:
        want = ref["tensors"].get(int(d["rank"]), {})
        n += len(want)
        if d.get("version") != ref["version"] or set(d["tensors"]) != set(want):
            bad.append(f"engine rank {d['rank']}: version {d.get('version')} / {ref['version']}, tensors "
                       f"{sorted(set(d['tensors']) ^ set(want))[:4]} on one side only")
        bad += [f"engine rank {d['rank']}: {k}" for k, h in sorted(want.items()) if d["tensors"].get(k) != h]
    return {"bytes_equal": bool(n) and not bad, "engine_tensors_checked": n, "bytes_differ": bad[:8],
            "fallback": ref["fallback"]}


def _nodes(trainers: list, servers: list, workers: list) -> dict:
    """The Ray node address each side ran on (different hosts with --hosts), and where each
    engine worker (vLLM's worker process, TP rank r) runs, as the worker itself reports it."""
    import ray

    where = lambda self: ray.util.get_node_ip_address()  # noqa: E731
    return {"trainers": sorted(set(ray.get([t.__ray_call__.remote(where) for t in trainers], timeout=60))),
            "server": ray.get(servers[0].__ray_call__.remote(where), timeout=60),
            "servers": ray.get([s.__ray_call__.remote(where) for s in servers], timeout=60),
            "rollout_workers": ray.get([w.__ray_call__.remote(where) for w in workers], timeout=60)}


if __name__ == "__main__":
    sys.exit(main())
