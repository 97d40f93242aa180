"""The OpenRLHF launcher and its checks, without starting Ray: ``--help`` lists OpenRLHF's and
fastsync's options; a hook point missing from the installed OpenRLHF stops the launch naming the
attribute and the supported versions, before anything is rebound; bad options are named.

OpenRLHF's ``ppo_actor`` imports ``flash_attn`` at top level, which does not install on CPU:
these tests put the STAND-IN in ``tests/support/fastsync_rigs/standins`` (pure-torch padding helpers
only) on the path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("openrlhf", reason="OpenRLHF not installed (see requirements/adapters.txt)")
pytest.importorskip("deepspeed", reason="DeepSpeed not installed (see requirements/adapters.txt)")
pytest.importorskip("vllm")

REPO = Path(__file__).resolve().parents[2]
from fastsync_rigs import STANDINS as STANDIN  # noqa: E402 - flash_attn STAND-IN (CPU host), tests/support


@pytest.fixture
def standin(monkeypatch):
    monkeypatch.syspath_prepend(str(STANDIN))


@pytest.mark.slow
def test_help_lists_openrlhf_and_fastsync_options():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(STANDIN), str(REPO), str(REPO / "adapters" / "openrlhf"),
                                                       os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-m", "fastsync_openrlhf.train_ppo_ray", "--help"], env=env,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    for opt in ("--vllm.num_engines", "--ds.zero_stage", "--train.colocate_all", "--actor.model_name_or_path",
                "--fastsync.transport", "--fastsync.moe", "--fastsync.disable", "--fastsync.timeout_s"):
        assert opt in p.stdout, opt


@pytest.mark.parametrize("module,attr", [
    ("openrlhf.trainer.ray.ppo_actor", "ActorPPOTrainer._init_vllm_sync_group"),
    ("openrlhf.trainer.ray.vllm_engine", "create_vllm_engines"),
])
def test_moved_hook_point_stops_the_launch_naming_it(standin, monkeypatch, module, attr):
    import importlib

    from fastsync_openrlhf import train_ppo_ray

    mod = importlib.import_module(module)
    owner, _, name = attr.rpartition(".")
    monkeypatch.delattr(getattr(mod, owner) if owner else mod, name)
    from openrlhf.trainer.ray import ppo_actor, vllm_engine

    before = (vllm_engine.RolloutRayActor, ppo_actor.PolicyModelActor)
    with pytest.raises(SystemExit) as exc:
        train_ppo_ray.main(["--help"])
    msg = str(exc.value)
    assert f"{module}.{attr}" in msg and "0.11.2" in msg and "will not fall back" in msg, msg
    assert (vllm_engine.RolloutRayActor, ppo_actor.PolicyModelActor) == before  # nothing rebound


def test_install_rebinds_openrlhf_names_to_the_subclasses(standin, monkeypatch):
    from openrlhf.trainer.ray import ppo_actor, vllm_engine

    from fastsync_openrlhf import hooks
    from fastsync_openrlhf.rollout import FastSyncRolloutRayActor
    from fastsync_openrlhf.trainer import FastSyncPolicyModelActor

    monkeypatch.setattr(vllm_engine, "RolloutRayActor", vllm_engine.RolloutRayActor)  # restored after the test
    monkeypatch.setattr(ppo_actor, "PolicyModelActor", ppo_actor.PolicyModelActor)
    hooks.install()
    assert vllm_engine.RolloutRayActor is FastSyncRolloutRayActor
    assert ppo_actor.PolicyModelActor is FastSyncPolicyModelActor
    hooks.check_hook_points()  # the subclasses still offer every hook point


def test_bad_options_are_named():
    from fastsync.errors import ConfigError
    from fastsync_openrlhf.config import FastSyncOptions, options_from_args

    with pytest.raises(ConfigError, match="--fastsync.transport"):
        FastSyncOptions(transport="rdma").validate()
    with pytest.raises(ConfigError, match="--fastsync.timeout_s"):
        FastSyncOptions(timeout_s=0).validate()
    with pytest.raises(ConfigError, match="bogus"):
        options_from_args(SimpleNamespace(fastsync=SimpleNamespace(bogus=1)))
    assert options_from_args(SimpleNamespace()) == FastSyncOptions()  # OpenRLHF started without the launcher
    with pytest.raises(ConfigError, match="--fastsync.fanout must be one of"):
        FastSyncOptions(fanout="ring").validate()
    with pytest.raises(ConfigError, match="--fastsync.delta writes over NIXL; --fastsync.transport torch does not"):
        FastSyncOptions(delta=True, transport="torch").validate()
    with pytest.raises(ConfigError, match="--fastsync.fanout chain may relay between engine ranks"):
        FastSyncOptions(fanout="chain", transport="torch").validate()
    assert FastSyncOptions(delta=True, fanout="chain").validate().fanout == "chain"  # deltas are relayed
    assert FastSyncOptions(delta=True, fanout="auto").validate().fanout == "auto"


def test_colocate_all_keeps_openrlhf_cuda_ipc_and_says_so(standin, capsys):
    import argparse

    from fastsync_openrlhf.train_ppo_ray import _check
    from fastsync_openrlhf.trainer import COLOCATE_MESSAGE

    ns = argparse.Namespace(**{"fastsync.enable": True, "fastsync.transport": "nixl", "train.colocate_all": True,
                               "vllm.sync_backend": "nccl", "train.async_enable": False})
    _check(ns)
    assert COLOCATE_MESSAGE in capsys.readouterr().out
    ns = argparse.Namespace(**{"fastsync.enable": True, "train.colocate_all": False, "vllm.sync_backend": "nccl"})
    _check(ns)
    assert capsys.readouterr().out == ""


def test_adapter_reaches_fastsync_through_one_module_and_public_names():
    """Only ``_fastsync.py`` imports fastsync, from ``fastsync.__all__`` (plus the vLLM worker
    extension package that ``worker_extension_cls`` strings name), so a core refactor touches
    one file of the adapter."""
    import ast

    import fastsync

    pkg = REPO / "adapters" / "openrlhf" / "fastsync_openrlhf"
    bad = []
    for f in sorted(pkg.glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            mods: list[tuple[str, list[str]]] = []
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "fastsync":
                mods.append((node.module, [a.name for a in node.names]))
            elif isinstance(node, ast.Import):
                mods += [(a.name, []) for a in node.names if a.name.split(".")[0] == "fastsync"]
            for module, names in mods:
                if f.name != "_fastsync.py":
                    bad.append(f"{f.name}:{node.lineno}: imports {module} (use fastsync_openrlhf._fastsync)")
                elif module == "fastsync":
                    bad += [f"{f.name}: {n} is not in fastsync.__all__" for n in names if n not in fastsync.__all__]
                elif module != "fastsync.engines.vllm":
                    bad.append(f"{f.name}:{node.lineno}: imports internal module {module}")
    assert bad == []


def _trainer(monkeypatch, *, fastsync: dict | None = None, colocate_ipc: bool = False, ds_tp: int = 1,
             ds_4bit: bool = False):
    """FastSyncActorPPOTrainer with the attributes OpenRLHF's (CUDA-only) __init__ sets, and
    OpenRLHF's own broadcast replaced by a recorder."""
    monkeypatch.syspath_prepend(str(STANDIN))
    from fastsync_openrlhf import trainer as tr

    calls: list[str] = []
    monkeypatch.setattr(tr._OriginalTrainer, "broadcast_to_vllm", lambda self: calls.append("openrlhf"))
    args = SimpleNamespace(vllm=SimpleNamespace(enable_prefix_caching=False),
                           ds=SimpleNamespace(zero_stage=3, tensor_parallel_size=ds_tp, lora=SimpleNamespace(rank=0),
                                              load_in_4bit=ds_4bit),
                           fastsync=SimpleNamespace(**(fastsync or {})))
    t = tr.FastSyncActorPPOTrainer.__new__(tr.FastSyncActorPPOTrainer)
    t.strategy, t.args, t.use_cuda_ipc = SimpleNamespace(args=args), args, colocate_ipc
    t.actor, t.vllm_engines = SimpleNamespace(model=None, is_vlm=False), ["engine"]
    return t, calls


def test_colocated_cuda_ipc_and_disable_keep_openrlhf_broadcast(monkeypatch, caplog):
    from fastsync_openrlhf.trainer import COLOCATE_MESSAGE

    t, calls = _trainer(monkeypatch, colocate_ipc=True)
    with caplog.at_level("WARNING"):
        t.broadcast_to_vllm()
        t.broadcast_to_vllm()
    assert calls == ["openrlhf", "openrlhf"]
    assert [r.getMessage() for r in caplog.records].count(COLOCATE_MESSAGE) == 1  # said once
    t, calls = _trainer(monkeypatch, fastsync={"enable": False})
    t.broadcast_to_vllm()
    assert calls == ["openrlhf"]


def test_unsupported_deepspeed_setting_is_refused_by_option_name(monkeypatch):
    from fastsync.errors import ConfigError

    t, calls = _trainer(monkeypatch, ds_tp=2)
    with pytest.raises(ConfigError, match=r"--ds.tensor_parallel_size 2.*--fastsync.disable"):
        t.broadcast_to_vllm()
    t, calls = _trainer(monkeypatch, ds_4bit=True)  # --ds.lora.rank goes merged; a 4-bit base does not
    with pytest.raises(ConfigError, match=r"--ds.load_in_4bit.*--fastsync.disable"):
        t.broadcast_to_vllm()
    assert calls == []  # no silent fall-through to OpenRLHF's broadcast
