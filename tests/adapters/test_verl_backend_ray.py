"""The ``fastsync`` backend driven by verl's own ``CheckpointEngineManager`` across real
processes (Ray actors on 127.0.0.1, NIXL between processes).

* ``build_process_group``: 2 trainer + 1 rollout rank, two syncs.
* Elastic replicas through the manager's real ``update_weights`` / ``remove_replicas`` /
  ``add_replicas``: the rollout ranks are verl's real ``CheckpointEngineWorker`` actors (verl's
  own RayWorkerGroup is built over them by the manager, and they run ``receive_weights`` inside
  verl's ``update_weights``); what they feed is a stand-in server adapter that records a digest
  of each received tensor (where verl's vLLM server would load them). The replicas' pause/resume
  calls (abort, release/resume KV cache) are no-op stand-ins: no vLLM server behind them.

The trainer worker group is a stand-in for verl's actor ``RayWorkerGroup`` (which needs verl's
Ray worker bootstrap and a model): it dispatches ``execute_checkpoint_engine`` the way DP_COMPUTE
does (element i of every list argument to rank i) and ``update_weights`` to every trainer rank,
returning Ray object refs."""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import tempfile
import time

import pytest

ray = pytest.importorskip("ray")
pytest.importorskip("verl.checkpoint_engine", reason="verl not installed (see requirements/adapters.txt)")
pytest.importorskip("nixl._api", reason="NIXL not installed")

from verl.checkpoint_engine import CheckpointEngineManager  # noqa: E402
from verl.workers.config import CheckpointEngineConfig  # noqa: E402

A, R = 2, 1


def _rank_actor():
    """The rank actor class, defined locally so Ray ships it by value (this test module is not
    importable by name in Ray's workers)."""

    class _Rank:
        def __init__(self, is_master: bool) -> None:
            import torch

            torch.set_num_threads(1)
            from verl.checkpoint_engine import CheckpointEngineRegistry
            from verl.utils.import_utils import import_external_libs

            import_external_libs("fastsync_verl")  # what custom_backend_module does in verl's workers
            self.engine = CheckpointEngineRegistry.new("fastsync", is_master=is_master, bucket_size=1 << 20,
                                                       control_host="127.0.0.1", timeout_s=30)

        def execute_checkpoint_engine(self, method: str, *args, **kwargs):  # as verl's workers expose it
            return getattr(self.engine, method)(*args, **kwargs)

        @staticmethod
        def weights(version: int):
            import torch

            g = torch.Generator().manual_seed(99 + version)
            return [(f"model.layers.{i}.mlp.down_proj.weight", torch.randn(256, 512, generator=g).bfloat16())
                    for i in range(4)] + [("model.norm.weight", torch.randn(512, generator=g))]

        def send(self, version: int) -> dict:
            return asyncio.run(self.engine.send_weights(iter(self.weights(version)), global_steps=version))

        def receive(self) -> list[tuple[str, str]]:
            import torch

            async def go():
                return [(n, hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest())
                        async for n, t in self.engine.receive_weights()]
            return asyncio.run(go())

        def digest(self, version: int) -> list[tuple[str, str]]:
            import torch

            return [(n, hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest())
                    for n, t in self.weights(version)]

    return ray.remote(num_cpus=0)(_Rank)


class _Group:
    """DP_COMPUTE dispatch of verl's RayWorkerGroup, reduced to what the manager calls on the
    actor group."""

    def __init__(self, actors: list) -> None:
        self.actors = actors
        self.world_size = len(actors)

    def execute_checkpoint_engine(self, method: list[str], **kwargs: list) -> list:
        return [a.execute_checkpoint_engine.remote(method[i], **{k: v[i] for k, v in kwargs.items()})
                for i, a in enumerate(self.actors)]

    def update_weights(self, global_steps: int | None = None, mode: str = "") -> list:
        assert mode == "fastsync", mode
        return [a.send.remote(global_steps) for a in self.actors]


def _rollout_worker():
    """verl's real CheckpointEngineWorker (the class verl's rollout replicas run beside each vLLM
    worker) with a recording stand-in server adapter, as a Ray actor class."""
    from verl.checkpoint_engine.base import CheckpointEngineWorker

    class _Recorder:  # stand-in for verl's vLLM server adapter: digests instead of load_weights
        replica_rank, is_leader_rank = 0, True

        def __init__(self) -> None:
            self.got: list[tuple[str, str]] = []

        async def update_weights(self, weights, global_steps=None, wire_format=None) -> None:
            import torch

            self.got = [(n, hashlib.sha256(t.contiguous().view(-1).view(torch.uint8).numpy()).hexdigest())
                        async for n, t in weights]

    class _Worker(CheckpointEngineWorker):
        def __init__(self, rollout_config) -> None:
            import torch

            from fastsync.bench.wt_serve import free_port

            torch.set_num_threads(1)
            # the port is picked here, just before verl binds it: one picked in the test process
            # seconds before (while the actor started) was taken by then in a loaded run (EADDRINUSE).
            # Free on every address, not only loopback: verl's TCPStore listens on all of them, and
            # a port free on 127.0.0.1 was still held on this host's own address (by a listener
            # there, such as NIXL's or Ray's) in a fresh-clone run (EADDRINUSE again)
            port = free_port("")
            # verl's Worker reads its (single-rank) process group from these, as RayWorkerGroup sets them
            os.environ.update(WORLD_SIZE="1", RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            super().__init__(rollout_config, None, _Recorder())

        def received(self) -> list[tuple[str, str]]:
            return self.server_adapter.got

    return ray.remote(num_cpus=0)(_Worker)


class _Replica:
    """Stand-in for verl's RolloutReplica: the rollout workers, and no-op pause/resume (no vLLM
    server behind them)."""

    def __init__(self, worker) -> None:
        self.workers = [worker]

    async def abort_all_requests(self, reject_request: bool = False) -> None: ...
    async def release_kv_cache(self) -> None: ...
    async def resume_kv_cache(self) -> None: ...
    async def resume_generation(self) -> None: ...


@pytest.fixture(scope="module")
def ray_local():
    tmp = tempfile.mkdtemp(prefix="fsray", dir="/tmp")
    saved = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"  # else Ray writes a token into the home folder
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, _temp_dir=tmp,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "RAY_AUTH_MODE": "disabled"}})
    try:
        yield
    finally:
        ray.shutdown()
        if saved is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = saved
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.slow
def test_verls_manager_builds_the_group_and_two_syncs_deliver(ray_local) -> None:
    rank_cls = _rank_actor()
    trainers = [rank_cls.remote(r == 0) for r in range(A)]
    rollouts = [rank_cls.remote(False) for _ in range(R)]
    actor_wg, rollout_wg = _Group(trainers), _Group(rollouts)
    config = CheckpointEngineConfig(backend="fastsync", custom_backend_module="fastsync_verl")
    manager = CheckpointEngineManager(config=config, actor_wg=actor_wg, replicas=[])
    try:
        for version in (1, 2):
            manager.build_process_group(rollout_wg)  # verl's steps 1-3: prepare, build_topology, init
            refs = [t.send.remote(version) for t in trainers] + [r.receive.remote() for r in rollouts]
            results = ray.get(refs, timeout=90)
            ray.get(actor_wg.execute_checkpoint_engine(["finalize"] * A)
                    + rollout_wg.execute_checkpoint_engine(["finalize"] * R), timeout=30)
            want = ray.get(trainers[0].digest.remote(version), timeout=30)
            assert results[A] == want  # every tensor, in verl's order, bit-identical
            sent = [results[r][f"fastsync/trainer{r}/sent_bytes"] for r in range(A)]
            total = 4 * 256 * 512 * 2 + 512 * 4
            assert sum(sent) == total and max(sent) <= 0.6 * total, sent
    finally:
        for a in trainers + rollouts:
            ray.get(a.execute_checkpoint_engine.remote("close"), timeout=30)
            ray.kill(a)


class _Elastic:
    """2 trainer ranks, verl's CheckpointEngineManager and real rollout CheckpointEngineWorkers."""

    def __init__(self, num_replicas: int) -> None:
        from verl.workers.config import RolloutConfig

        self.config = CheckpointEngineConfig(backend="fastsync", custom_backend_module="fastsync_verl",
                                             update_weights_bucket_megabytes=1,
                                             engine_kwargs={"fastsync": {"control_host": "127.0.0.1",
                                                                         "timeout_s": 30}})
        self.rollout_config = RolloutConfig(name="vllm", checkpoint_engine=self.config)
        rank_cls = _rank_actor()
        self.trainers = [rank_cls.remote(r == 0) for r in range(A)]
        self.replicas: list[_Replica] = []
        self.manager = CheckpointEngineManager(config=self.config, actor_wg=_Group(self.trainers),
                                               replicas=[self.new_replica() for _ in range(num_replicas)])

    def new_replica(self) -> _Replica:
        rep = _Replica(_rollout_worker().remote(self.rollout_config))
        self.replicas.append(rep)
        return rep

    def sync(self, step: int) -> None:
        self.manager.update_weights(global_steps=step)  # verl's own: abort, build group, send/receive, finalize

    def received(self, rep: _Replica) -> list[tuple[str, str]]:
        return ray.get(rep.workers[0].received.remote(), timeout=30)

    def want(self, step: int) -> list[tuple[str, str]]:
        return ray.get(self.trainers[0].digest.remote(step), timeout=30)

    def setups(self) -> list[int]:
        handles = self.trainers + [r.workers[0] for r in self.replicas]
        return [d["setups"] for d in ray.get([h.execute_checkpoint_engine.remote("describe") for h in handles],
                                              timeout=30)]

    def close(self) -> None:
        handles = self.trainers + [r.workers[0] for r in self.replicas]
        for h in handles:
            try:
                ray.get(h.execute_checkpoint_engine.remote("close"), timeout=30)
            finally:
                ray.kill(h)


@pytest.mark.slow
def test_removed_then_re_added_replica_gets_a_fresh_plan_and_the_current_weights(ray_local) -> None:
    job = _Elastic(2)
    try:
        r0, r1 = job.manager.replicas
        job.sync(1)
        assert job.received(r0) == job.received(r1) == job.want(1)
        job.manager.remove_replicas([r1])
        job.sync(2)  # r1 sits this one out and keeps its old state
        assert job.received(r0) == job.want(2) and job.received(r1) == job.want(1)
        job.manager.add_replicas([r1])
        job.sync(3)  # was: "version 2 incomplete ... no write completed" on the re-added rank
        assert job.received(r0) == job.received(r1) == job.want(3)
        before = job.setups()
        job.sync(4)  # members unchanged: the session and its plan are replayed, nothing set up again
        assert job.received(r0) == job.received(r1) == job.want(4)
        assert job.setups() == before, (before, job.setups())
    finally:
        job.close()


@pytest.mark.slow
def test_brand_new_replica_added_after_a_sync_gets_the_current_weights(ray_local) -> None:
    job = _Elastic(1)
    try:
        (r0,) = job.manager.replicas
        job.sync(1)
        assert job.received(r0) == job.want(1)
        new = job.new_replica()
        job.manager.add_replicas([new])
        job.sync(2)  # was: the new rank timed out waiting for 'inventory'
        assert job.received(r0) == job.received(new) == job.want(2)
        assert job.setups()[-1] == 1  # the new rank set up once, in the new session
    finally:
        job.close()


@pytest.mark.slow
def test_ray_calls_are_awaited_with_a_deadline_and_their_errors_named(ray_local) -> None:
    """The host kit's ``ray_result`` (both adapters' Ray calls): a fastsync error raised in the
    actor comes back as its own class, anything else as SyncError naming the call, and a call
    that does not answer by its deadline as SyncError, not a hang."""
    from fastsync import ConfigError, SyncError, ray_result

    @ray.remote
    def call(kind: str) -> list:
        if kind == "config":
            raise ConfigError("engine_kwargs.fastsync.fanout must be one of off, auto, chain, direct")
        if kind == "crash":
            raise RuntimeError("CUDA error: an illegal memory access")
        if kind == "slow":
            time.sleep(30)
        return [{"rank": 0}]

    assert ray_result(call.remote("ok"), 60.0, "engine 0: describe") == [{"rank": 0}]
    with pytest.raises(ConfigError, match="fanout must be one of"):
        ray_result(call.remote("config"), 60.0, "engine 0: connect")
    crashed = r"(?s)engine 0: update failed: RayTaskError\(RuntimeError\).*illegal memory"
    with pytest.raises(SyncError, match=crashed) as e:
        ray_result(call.remote("crash"), 60.0, "engine 0: update")
    assert "\x1b[" not in str(e.value)  # Ray's terminal colours stripped
    t0 = time.monotonic()
    slow = call.remote("slow")
    with pytest.raises(SyncError, match="engine 0: version did not answer within 2 s"):
        ray_result(slow, 2.0, "engine 0: version")
    assert time.monotonic() - t0 < 20
    ray.cancel(slow, force=True)
