"""Where the adapter hooks into OpenRLHF, checked before anything starts.

OpenRLHF has no plugin registry, so the adapter replaces names in OpenRLHF's modules. Each hook
point is listed once here (:data:`HOOK_POINTS`); :func:`check_hook_points` resolves every one
(``fastsync.resolve_hook_point``) and raises ``HookPointError`` naming the first missing attribute
and the supported OpenRLHF versions, so a moved hook point stops the launch instead of silently
falling back to OpenRLHF's own per-parameter broadcast.

:func:`install` rebinds, in the driver process:

* ``openrlhf.trainer.ray.vllm_engine.RolloutRayActor`` -> ``fastsync_openrlhf.rollout``'s subclass
  (``create_vllm_engines`` looks the name up in its module at call time);
* ``openrlhf.trainer.ray.ppo_actor.PolicyModelActor`` -> ``fastsync_openrlhf.trainer``'s subclass
  (``cli/train_ppo_ray.py`` imports the name from that module when it runs).

``ActorPPOTrainer`` is rebound inside each trainer Ray worker by the PolicyModelActor subclass
(:func:`fastsync_openrlhf.trainer.install_trainer`), where it is instantiated.
"""

from __future__ import annotations

import importlib.util

from fastsync_openrlhf import SUPPORTED_OPENRLHF
from fastsync_openrlhf._fastsync import HookPointError, resolve_hook_point

__all__ = ["HookPointError", "HOOK_POINTS", "ROLLOUT_HOOK_POINTS", "check_hook_points", "resolve", "install"]

#: (module, dotted attribute) the trainer side (driver and trainer workers) relies on.
HOOK_POINTS: tuple[tuple[str, str], ...] = (
    ("openrlhf.trainer.ray.ppo_actor", "PolicyModelActor"),
    ("openrlhf.trainer.ray.ppo_actor", "PolicyModelActor.__ray_actor_class__"),
    ("openrlhf.trainer.ray.ppo_actor", "PolicyModelActor.__ray_actor_class__.init_model_from_pretrained"),
    ("openrlhf.trainer.ray.ppo_actor", "ActorPPOTrainer"),
    ("openrlhf.trainer.ray.ppo_actor", "ActorPPOTrainer.broadcast_to_vllm"),
    ("openrlhf.trainer.ray.ppo_actor", "ActorPPOTrainer._init_vllm_sync_group"),
)

#: (module, dotted attribute) the rollout side relies on (no DeepSpeed behind these imports).
ROLLOUT_HOOK_POINTS: tuple[tuple[str, str], ...] = (
    ("openrlhf.trainer.ray.vllm_engine", "RolloutRayActor"),
    ("openrlhf.trainer.ray.vllm_engine", "RolloutRayActor.__ray_actor_class__"),
    ("openrlhf.trainer.ray.vllm_engine", "RolloutRayActor.__ray_actor_class__.__init__"),
    ("openrlhf.trainer.ray.vllm_engine", "create_vllm_engines"),
    ("openrlhf.trainer.ray.vllm_worker_wrap", "WorkerWrap"),
    ("openrlhf.trainer.ray.vllm_worker_wrap", "WorkerWrap.update_weight"),
)

_CLI = "openrlhf.cli.train_ppo_ray"


def resolve(module: str, dotted: str) -> object:
    """``module.dotted``, or HookPointError naming the missing attribute and supported versions."""
    return resolve_hook_point(module, dotted, adapter="fastsync_openrlhf", dist="OpenRLHF",
                              supported=SUPPORTED_OPENRLHF)


def check_hook_points(*, trainer: bool = True, rollout: bool = True) -> None:
    """Resolve every hook point (and that the CLI module exists); HookPointError otherwise."""
    points = (ROLLOUT_HOOK_POINTS if rollout else ()) + (HOOK_POINTS if trainer else ())
    for module, dotted in points:
        resolve(module, dotted)
    if trainer and importlib.util.find_spec(_CLI) is None:  # found, not imported: it is OpenRLHF's __main__
        raise HookPointError(f"fastsync_openrlhf: module {_CLI!r} is missing in the installed OpenRLHF; supported "
                             f"OpenRLHF versions: {', '.join(SUPPORTED_OPENRLHF)}")


def install() -> None:
    """Check every hook point, then rebind ``RolloutRayActor`` and ``PolicyModelActor`` in
    OpenRLHF's modules to fastsync's subclasses (idempotent)."""
    check_hook_points()
    from openrlhf.trainer.ray import ppo_actor, vllm_engine

    from fastsync_openrlhf.rollout import FastSyncRolloutRayActor
    from fastsync_openrlhf.trainer import FastSyncPolicyModelActor

    vllm_engine.RolloutRayActor = FastSyncRolloutRayActor
    ppo_actor.PolicyModelActor = FastSyncPolicyModelActor
