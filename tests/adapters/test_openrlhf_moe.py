"""``--fastsync.moe``: the OpenRLHF actor's MoE blocks are swapped for fastsync's, under real
DeepSpeed ZeRO-3 (2 spawned ranks, gloo): the HF model is built partitioned as OpenRLHF's
``Actor`` builds it, swapped block by block with each block's parameters gathered, then
``deepspeed.initialize`` partitions the new parameters. Names and values stay the HF model's
(so the weight sync plans them unchanged), logits match, a training step runs."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("deepspeed", reason="DeepSpeed not installed (see requirements/adapters.txt)")
pytest.importorskip("openrlhf", reason="OpenRLHF not installed (see requirements/adapters.txt)")

JOB = Path(__file__).with_name("openrlhf_moe_job.py")
REPO = Path(__file__).resolve().parents[2]
from fastsync_rigs import STANDINS as STANDIN  # noqa: E402 - flash_attn STAND-IN (CPU host), tests/support


@pytest.mark.slow
def test_moe_swap_under_zero3_keeps_names_values_and_trains(tmp_path, run_workers, free_port):
    from fastsync.demo.checkpoints import build_tiny_checkpoint

    model_dir = str(build_tiny_checkpoint("tiny-qwen3-moe", tmp_path / "ckpt", dtype="float32"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "adapters" / "openrlhf"),
                                                       os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    port = free_port()
    outs = run_workers([[sys.executable, str(JOB), str(r), "2", str(port), model_dir] for r in range(2)], env, 300)
    results = []
    for out in outs:
        lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
        assert lines, out[-3000:]
        results.append(json.loads(lines[-1][7:]))
    for r in results:
        assert r["partitioned_before"], "the model was not built partitioned (zero.Init)"
        assert sorted(r["swapped"]) == ["model.layers.0.mlp", "model.layers.1.mlp"]
        assert r["blocks"] == 2
        assert r["partitioned_after"], "DeepSpeed did not partition the swapped blocks' parameters"
        assert r["names_equal"], f"rank {r['rank']}: parameter names differ from the HF model's"
        assert r["same_values"], f"rank {r['rank']}: values differ from the HF model's (max abs diff): {r['differing']}"
        assert r["max_logit_diff"] < 1e-4
        assert math.isfinite(r["loss"])


def test_install_trainer_wraps_openrlhf_actor_only_with_the_option(monkeypatch):
    monkeypatch.syspath_prepend(str(STANDIN))
    from types import SimpleNamespace

    from openrlhf.trainer.ray import ppo_actor

    from fastsync_openrlhf.trainer import FastSyncActorPPOTrainer, install_trainer

    monkeypatch.setattr(ppo_actor, "Actor", ppo_actor.Actor)  # restored after the test
    monkeypatch.setattr(ppo_actor, "ActorPPOTrainer", ppo_actor.ActorPPOTrainer)
    original = ppo_actor.Actor
    install_trainer(SimpleNamespace(fastsync=SimpleNamespace(moe="auto")))
    assert getattr(ppo_actor.Actor, "_fastsync_moe", None) == "auto"
    assert ppo_actor.ActorPPOTrainer is FastSyncActorPPOTrainer
    install_trainer(SimpleNamespace(fastsync=SimpleNamespace(moe="off")))
    assert ppo_actor.Actor is original
