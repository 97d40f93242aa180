"""What a verl rollout rank reports for the session's path (``fastsync_verl.server.capability``; the
decision itself, ``fastsync.host.path_choice``, is tested in tests/host) and the backend's checks. Real control store,
verl's real ``RolloutConfig``; the server adapters are stand-ins holding verl's config (the real
``ServerAdapter`` is exercised by tests/adapters/test_verl_smoke.py)."""

from __future__ import annotations

import types

import pytest

pytest.importorskip("verl.checkpoint_engine", reason="verl not installed (see requirements/adapters.txt)")

from verl.workers.config import RolloutConfig  # noqa: E402

from fastsync import ConfigError  # noqa: E402
from fastsync_verl.checkpoint_engine import MEGATRON_NOTICE, FastSyncCheckpointEngine  # noqa: E402
from fastsync_verl.server import capability  # noqa: E402

pytest.importorskip("vllm", reason="vLLM not installed")
EXTENSION_PATH = "fastsync_verl.extension.FastSyncVerlWorkerExtension"


@pytest.fixture(scope="module")
def shim(tmp_path_factory):
    from fastsync_rigs.verl_cpu import vllm_dist_shim

    vllm_dist_shim(str(tmp_path_factory.mktemp("vllmdist")))  # verl's vLLM package on the CPU build


def _adapter(leader: bool = True, node_rank: int = 0, **cfg) -> types.SimpleNamespace:
    ev = cfg.pop("engine_kwargs", {"vllm": {"worker_extension_cls": EXTENSION_PATH}})
    rc = RolloutConfig(name=cfg.pop("name", "vllm"), tensor_model_parallel_size=cfg.pop("tp", 1), engine_kwargs=ev, **cfg)
    return types.SimpleNamespace(config=rc, model_config=types.SimpleNamespace(lora={}, lora_rank=0),
                                 _has_server=leader, node_rank=node_rank)


def test_capability_names_what_blocks_the_in_place_path(shim) -> None:
    assert capability(_adapter()) == (True, "", True, 1)
    assert capability(_adapter(leader=False, tp=2)) == (True, "", False, 2)
    # a replica across nodes: a rank on node rank 1 joins (its worker is driven by the leader's engine)
    assert capability(_adapter(leader=False, tp=2, node_rank=1)) == (True, "", False, 2)
    ok, why, _, _ = capability(_adapter(leader=True, tp=2, node_rank=1))  # verl never leads from there
    assert not ok and "node rank 1" in why and "headless" in why
    ok, why, _, _ = capability(_adapter(engine_kwargs={"vllm": {}}))
    assert not ok and "worker_extension_cls" in why
    ok, why, _, _ = capability(_adapter(engine_kwargs={"vllm": {"worker_extension_cls":
                                                                "verl.workers.rollout.vllm_rollout.utils.vLLMColocateWorkerExtension"}}))
    assert not ok and EXTENSION_PATH in why  # verl's own extension alone cannot answer fastsync's calls
    ok, why, _, _ = capability(_adapter(data_parallel_size=2))
    assert not ok and "data_parallel_size=2" in why
    ok, why, _, _ = capability(_adapter(name="sglang"))
    assert not ok and "sglang" in why
    lora = _adapter()
    lora.model_config.lora = {"rank": 8}
    ok, why, _, _ = capability(lora)
    assert not ok and "LoRA adapter (rank 8, lora.merge=False)" in why  # verl serves it from a LoRA slot
    lora.model_config.lora = {}
    lora.model_config.lora_rank = 8  # verl's older key, same rule
    assert not capability(lora)[0]
    lora.model_config.lora = {"rank": 8, "merge": True}  # merged: vLLM without LoRA, base names, in place
    assert capability(lora) == (True, "", True, 1)


def test_adopted_version_moves_the_master_on() -> None:
    from fastsync.host import MasterState

    eng = FastSyncCheckpointEngine(1 << 20)
    eng._master, eng._version = MasterState(), 1
    eng._master.spend()
    assert eng.adopt_version(13) == 13 and eng._master.spend()["version"] == 14  # the next sync counts on
    assert eng.adopt_version(5) == 13  # never back


def test_bad_inplace_value_and_megatron_notice(monkeypatch) -> None:
    with pytest.raises(ConfigError, match="engine_kwargs.fastsync.inplace must be one of"):
        FastSyncCheckpointEngine(1 << 20, inplace="yes")
    import sys

    monkeypatch.setitem(sys.modules, "verl.workers.engine.megatron.transformer_impl", types.ModuleType("m"))
    eng = FastSyncCheckpointEngine(1 << 20, trainer_shards="auto")
    assert eng._shard_module(iter([]), 0) == (None, MEGATRON_NOTICE)
    with pytest.raises(ConfigError, match="Megatron actor"):
        FastSyncCheckpointEngine(1 << 20, trainer_shards="on")._shard_module(iter([]), 0)
