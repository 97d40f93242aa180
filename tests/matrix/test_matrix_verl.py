"""The sync matrix through verl's checkpoint-engine backend: verl's own ``CheckpointEngineManager``
(``backend=fastsync``, the cell's ``engine_kwargs.fastsync.{delta,fanout}``) from 2 real FSDP2
trainer ranks (Ray actors, gloo) into two identical replicas, each verl's own vLLM server
(``vLLMHttpServer``, AsyncLLM on the real vLLM CPU engine, the composed worker extension) with its
``CheckpointEngineWorker``. Each cell takes real AdamW steps, then every engine tensor's bytes
must equal the trainer's (SHA-256, gathered FSDP2 weights through the plan's reference) and both
servers' greedy tokens the trainer model's own.

Rig: ``examples/verl/sync_smoke.py`` (its trainer, rollout worker and stand-ins, listed there).
One Ray cluster and the two servers serve every cell (started once, a few minutes); each cell
builds a fresh backend on every rank, as a new trainer job or new options would: a new master
meeting servers that earlier sessions synced, whose versions must go on from theirs.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM not installed")
ray = pytest.importorskip("ray", reason="Ray not installed")
pytest.importorskip("verl.workers.engine.fsdp.transformer_impl", reason="verl's FSDP engine does not import")
pytest.importorskip("nixl._api", reason="NIXL not installed")

SMOKE = Path(__file__).resolve().parents[2] / "examples" / "verl"  # sync_smoke.py: the rig
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, str(SMOKE))
from matrix_support import FANOUT, assert_digest, cell_id, cell_params, first_version, reference_digest  # noqa: E402

pytestmark = pytest.mark.slow

MAX_TOKENS = 8
PROMPTS = [[5, 6, 7, 8], [100, 200, 300]]
TIMEOUT_S = 120.0


def _calls():
    """Calls run through ``__ray_call__``, defined in a function so Ray ships them by value."""

    def renew(self, kwargs: dict):  # a fresh backend on this rank (a new master on trainer rank 0), as
        from verl.checkpoint_engine import CheckpointEngineRegistry  # verl builds it with the job's kwargs

        trainer = hasattr(self, "engine")  # sync_smoke's Trainer; else verl's CheckpointEngineWorker
        old = self.engine if trainer else self.checkpoint_engine
        old.close()
        new = CheckpointEngineRegistry.new("fastsync", is_master=trainer and self.rank == 0, bucket_size=1 << 20,
                                           control_host="127.0.0.1", timeout_s=TIMEOUT_S, **kwargs)
        if trainer:
            self.engine = new
        else:
            self.checkpoint_engine = new
        return True

    def trainer_state(self):  # trainer rank 0: what its session planned and sent
        ws = self.engine._end.inplace.ws
        tensors = {int(w["rank"]): w["tensors"] for e in ws.engine_info for w in e}
        return {"version": ws.version, "kind": getattr(ws, "last_kind", None), "tensors": tensors,
                "planned": (ws.plan.fanout.replicas if ws.plan.fanout is not None else 1, ws.plan.has_relays)}

    def full_weights(self, dump_dir: str, after_s: float):  # collective: every FSDP2 rank gathers
        import faulthandler

        from fastsync.demo.run import _full_state

        # the gather once hung (a loaded run, 4ca0a80): every thread's stack goes to a file the
        # test reads when its deadline passes
        with open(f"{dump_dir}/rank{self.rank}.txt", "w") as out:
            faulthandler.dump_traceback_later(after_s, file=out)
            try:
                full = _full_state(self.model)
            finally:
                faulthandler.cancel_dump_traceback_later()
        return full if self.rank == 0 else None

    def digest(self):  # in verl's server actor: the workers' digests through AsyncLLM (verl's own drops replies)
        import asyncio

        loop = self.engine.output_handler.get_loop()
        return asyncio.run_coroutine_threadsafe(self.engine.collective_rpc("fastsync_digest"), loop).result(120)

    def global_steps(self):
        return self.global_steps

    return renew, trainer_state, full_weights, digest, global_steps


@pytest.fixture(scope="module")
def rig(tmp_path_factory):
    """Ray, the tiny checkpoint, 2 FSDP2 trainer actors and two verl vLLM servers (replicas 0, 1)."""
    from fastsync_rigs.verl_cpu import vllm_dist_shim, write_word_tokenizer

    work = tmp_path_factory.mktemp("verl-matrix")
    vllm_dist_shim(str(work / "dist"))  # before anything imports verl's vLLM modules
    import transformers

    import sync_smoke  # noqa: F401 - the rig's classes, imported by name in Ray's workers too
    from fastsync.demo.checkpoints import build_tiny_checkpoint
    from fastsync_verl.extension import EXTENSION_PATH
    from verl.workers.config import CheckpointEngineConfig, HFModelConfig, RolloutConfig
    from verl.workers.rollout.replica import RolloutMode
    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer

    model_dir = str(build_tiny_checkpoint("tiny-qwen3", str(work / "tiny-qwen3"), dtype="float32"))
    write_word_tokenizer(model_dir, transformers.AutoConfig.from_pretrained(model_dir).vocab_size)
    env = {"OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled", "VERL_PLATFORM": "cpu", "GLOO_SOCKET_IFNAME": "lo",
           "PYTHONPATH": os.pathsep.join([str(SMOKE), os.environ.get("PYTHONPATH", "")]),
           "TOKENIZERS_PARALLELISM": "false", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    ray_tmp = tempfile.mkdtemp(prefix="fsm", dir="/tmp")  # AF_UNIX paths under it stay < 108 bytes
    mp = pytest.MonkeyPatch()
    mp.setenv("RAY_AUTH_MODE", "disabled")  # else Ray writes a token into the home folder
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=ray_tmp,
             runtime_env={"env_vars": env, "worker_process_setup_hook": "fastsync_rigs.verl_cpu.use_cpu_platform"})
    r = type("Rig", (), {})()
    try:
        r.model = HFModelConfig(path=model_dir)
        r.rollout = lambda ce: RolloutConfig(  # verl's rollout config, as sync_smoke.py builds it
            name="vllm", mode="async", tensor_model_parallel_size=1, dtype="float32", enforce_eager=True,
            max_model_len=512, load_format="auto", free_cache_engine=False, enable_sleep_mode=False,
            max_num_batched_tokens=512, max_num_seqs=8, skip_tokenizer_init=False, enable_prefix_caching=False,
            checkpoint_engine=ce, engine_kwargs={"vllm": {"worker_extension_cls": EXTENSION_PATH,
                                                          "kv_cache_memory_bytes": 64 << 20}})
        ce = CheckpointEngineConfig(backend="fastsync", custom_backend_module="fastsync_verl",
                                    engine_kwargs={"fastsync": {"control_host": "127.0.0.1", "timeout_s": TIMEOUT_S}})
        r.servers = [ray.remote(vLLMHttpServer).options(name=f"vllm_server_{i}_0", num_cpus=0).remote(
            config=r.rollout(ce), model_config=r.model, rollout_mode=RolloutMode.STANDALONE, workers=[],
            replica_rank=i, node_rank=0, gpus_per_node=1, nnodes=1, cuda_visible_devices="0") for i in range(2)]
        masters = ray.get([s.get_master_address.remote() for s in r.servers], timeout=600)
        launched = [s.launch_server.remote(*m) for s, m in zip(r.servers, masters)]
        trainer_cls = ray.remote(num_cpus=0)(sync_smoke.Trainer)
        gloo = sync_smoke._free_port()
        r.trainers = [trainer_cls.remote(k, 2, gloo, model_dir, TIMEOUT_S, {}, "127.0.0.1") for k in range(2)]
        ray.get(launched, timeout=900)
        worker_cls = ray.remote(num_cpus=0)(sync_smoke.rollout_worker_cls())  # verl's, one per replica
        r.workers = [worker_cls.remote(r.rollout(ce), r.model, sync_smoke._free_port(), 0, 1, 1, "127.0.0.1", i)
                     for i in range(2)]
        ray.get([w.__ray_ready__.remote() for w in r.workers], timeout=600)
        r.held = 0
        yield r
    finally:
        for h in getattr(r, "trainers", []) + getattr(r, "workers", []):
            try:
                ray.get(h.execute_checkpoint_engine.remote("close"), timeout=30)
            except Exception:  # noqa: BLE001 - shutting down regardless
                pass
        ray.shutdown()
        mp.undo()
        shutil.rmtree(ray_tmp, ignore_errors=True)


def _gather(rig, full_weights, timeout_s: float = 120.0) -> dict:
    """Trainer rank 0's full state (``full_weights`` on every rank); past the deadline, an error
    with each rank's thread stacks, dumped a little before it."""
    dump = tempfile.mkdtemp(prefix="fsm-gather", dir="/tmp")
    try:
        refs = [t.__ray_call__.remote(full_weights, dump, timeout_s - 15.0) for t in rig.trainers]
        try:
            return ray.get(refs, timeout=timeout_s)[0]
        except ray.exceptions.GetTimeoutError:
            stacks = {f: Path(dump, f).read_text()[-6000:] for f in sorted(os.listdir(dump))}
            raise AssertionError(f"the trainers' full-state gather did not return in {timeout_s} s; "
                                 f"their stacks: {stacks}") from None
    finally:
        shutil.rmtree(dump, ignore_errors=True)


@pytest.mark.parametrize("cell", cell_params())
def test_verl_matrix(rig, cell):
    from verl.checkpoint_engine import CheckpointEngineManager
    from verl.workers.config import CheckpointEngineConfig

    import sync_smoke
    from fastsync_verl.checkpoint_engine import FastSyncCheckpointEngine

    payload, route = cell
    kwargs = {**sync_smoke.KWARGS, "delta": payload == "delta", "fanout": FANOUT[route]}
    # what every rank checks when verl builds the backend ("off": no FSDP hook in this process)
    FastSyncCheckpointEngine(1 << 20, **{**kwargs, "trainer_shards": "off"})
    renew, trainer_state, full_weights, digest, global_steps = _calls()
    ray.get([h.__ray_call__.remote(renew, kwargs) for h in rig.trainers + rig.workers], timeout=120)
    ce = CheckpointEngineConfig(backend="fastsync", custom_backend_module="fastsync_verl",
                                engine_kwargs={"fastsync": kwargs})
    manager = CheckpointEngineManager(config=ce, actor_wg=sync_smoke.TrainerGroup(rig.trainers),
                                      replicas=[sync_smoke.Replica([w]) for w in rig.workers])
    base = first_version(cell)  # verl's global_steps for this cell
    for step in range(2 if payload == "delta" else 1):
        ray.get([t.train_step.remote(base + step) for t in rig.trainers], timeout=300)
        manager.update_weights(global_steps=base + step)  # verl's own flow: group, send/receive, finalize
        state = ray.get(rig.trainers[0].__ray_call__.remote(trainer_state), timeout=60)
        assert state["planned"] == (2, route == "relayed"), state["planned"]
        # a new master meeting servers earlier cells synced: its versions go on above theirs
        assert state["version"] > rig.held, (state["version"], rig.held)
        rig.held = state["version"]
        if payload == "delta":  # dense first, then a delta
            assert state["kind"] == ("delta" if step else "dense"), state["kind"]
        full = _gather(rig, full_weights)
        want = ray.get([t.reference.remote(PROMPTS, MAX_TOKENS) for t in rig.trainers], timeout=300)[0]
        for i, server in enumerate(rig.servers):
            what = f"{cell_id(cell)} step {step}, replica {i}"
            (d,) = ray.get(server.__ray_call__.remote(digest), timeout=180)
            assert d.get("version") == state["version"], (what, d)
            assert_digest(d["tensors"], reference_digest(full, state["tensors"][d["rank"]]), what)
            assert ray.get(server.__ray_call__.remote(global_steps), timeout=60) == base + step, what
            assert sync_smoke.generate(server, PROMPTS, MAX_TOKENS, f"m{base + step}-{i}") == want, \
                f"{what}: tokens differ from the trainer's"
