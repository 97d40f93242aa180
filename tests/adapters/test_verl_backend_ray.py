"""The ``fastsync`` backend driven by verl's own ``CheckpointEngineManager.build_process_group``
across real processes: 2 trainer + 1 rollout Ray actors on 127.0.0.1 (NIXL between processes),
two syncs. The worker groups are a stand-in for verl's ``RayWorkerGroup`` (which needs verl's
Ray worker bootstrap): they dispatch ``execute_checkpoint_engine`` the way its DP_COMPUTE mode
does (element i of every list argument to rank i) and return Ray object refs."""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import tempfile

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
    """DP_COMPUTE dispatch of verl's RayWorkerGroup, reduced to what build_process_group calls."""

    def __init__(self, actors: list) -> None:
        self.actors = actors
        self.world_size = len(actors)

    def execute_checkpoint_engine(self, method: list[str], **kwargs: list) -> list:
        return [a.execute_checkpoint_engine.remote(method[i], **{k: v[i] for k, v in kwargs.items()})
                for i, a in enumerate(self.actors)]


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
