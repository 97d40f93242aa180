"""OpenRLHF's trainer classes with fastsync's sync (imported in the driver and the trainer Ray
workers only: it imports DeepSpeed through OpenRLHF's ``ppo_actor``).

* :class:`FastSyncActorPPOTrainer` replaces ``_init_vllm_sync_group`` (OpenRLHF's rank-0 NCCL
  group) and ``broadcast_to_vllm`` (per-parameter gather + rank-0 broadcast) with one
  ``fastsync.DeepSpeedWeightSync`` per rank (each writes its ZeRO partitions into the engines), set
  up at the first sync (all ranks call ``broadcast_to_vllm``; OpenRLHF calls
  ``_init_vllm_sync_group`` on rank 0 only).
* :class:`FastSyncPolicyModelActor` (``ray.remote`` over a subclass of OpenRLHF's
  ``PolicyModelActor`` class) rebinds ``ppo_actor.ActorPPOTrainer`` (and, with
  ``--fastsync.moe``, ``ppo_actor.Actor``) inside its own Ray worker before OpenRLHF builds them.

With ``--ds.lora.rank R`` the actor is a PEFT model: ``DeepSpeedWeightSync`` sends it merged
(``W + lora_alpha/r * B @ A`` under the base names, each rank its own slice of each targeted weight;
``fastsync.host.lora_merge``), so the engines, started without LoRA as OpenRLHF starts them, serve
the trained policy. Unsupported PEFT settings are refused by name at the first sync.

``--train.colocate_all`` with the ``nccl`` sync backend keeps OpenRLHF's CUDA-IPC path (trainer
and engine share each GPU, so there is no network hop for fastsync to spread out; a same-device
IPC copy is already the floor), and says so in the log.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import ray
from openrlhf.trainer.ray import ppo_actor

from fastsync_openrlhf._fastsync import ConfigError, DeepSpeedWeightSync, RpcEngine, node_address, ray_result
from fastsync_openrlhf._fastsync import patch_moe_partitioned
from fastsync_openrlhf.config import FastSyncOptions, options_from_args

__all__ = ["FastSyncActorPPOTrainer", "FastSyncPolicyModel", "FastSyncPolicyModelActor", "install_trainer",
           "COLOCATE_MESSAGE"]

log = logging.getLogger(__name__)

COLOCATE_MESSAGE = ("fastsync: --train.colocate_all with the nccl sync backend: keeping OpenRLHF's CUDA-IPC "
                    "weight sync (trainer and engine share each GPU; fastsync syncs only across devices)")

_OriginalTrainer = ppo_actor.ActorPPOTrainer
_OriginalActor = ppo_actor.Actor


class FastSyncActorPPOTrainer(_OriginalTrainer):  # type: ignore[misc, valid-type]
    """OpenRLHF's ``ActorPPOTrainer`` whose weight sync is fastsync's (see module doc)."""

    def _fastsync_options(self) -> FastSyncOptions:
        return options_from_args(self.strategy.args)

    def _init_vllm_sync_group(self, backend: str) -> None:
        if not self._fastsync_options().enable:
            return super()._init_vllm_sync_group(backend)
        # fastsync's set-up is collective (every rank plans its own partitions): deferred to the
        # first broadcast_to_vllm, which OpenRLHF runs on every rank.
        self._fastsync_sync = None

    def _fastsync_uses_openrlhf_path(self) -> bool:
        if not self._fastsync_options().enable:
            return True
        if getattr(self, "use_cuda_ipc", False):
            if not getattr(self, "_fastsync_said_colocate", False):
                log.warning(COLOCATE_MESSAGE)
                print(COLOCATE_MESSAGE)
                self._fastsync_said_colocate = True
            return True
        return False

    def _fastsync_build(self) -> DeepSpeedWeightSync:
        args = self.strategy.args
        opts = self._fastsync_options()
        ds = getattr(args, "ds", None)
        tp = int(getattr(ds, "tensor_parallel_size", 1) or 1)
        if tp > 1:
            raise ConfigError(f"fastsync_openrlhf: --ds.tensor_parallel_size {tp} (DeepSpeed AutoTP) is not planned "
                              "by fastsync yet; run with --fastsync.disable to keep OpenRLHF's broadcast")
        if getattr(ds, "load_in_4bit", False):
            raise ConfigError("fastsync_openrlhf: --ds.load_in_4bit (a 4-bit base) is not synced by fastsync; "
                              "run with --fastsync.disable")
        if getattr(self.actor, "is_vlm", False):
            raise ConfigError("fastsync_openrlhf: vision-language actors are not synced by fastsync yet; "
                              "run with --fastsync.disable")
        host = opts.control_host or node_address()  # where rank 0 serves the control plane; the engines join it
        engines = [RpcEngine.over_ray(e, name=f"vLLM engine {i}", timeout_s=opts.timeout_s,
                                      connect_options={"control_host": host}) for i, e in enumerate(self.vllm_engines)]
        return DeepSpeedWeightSync(self.actor.model.module, engines=engines,
                                   zero_stage=int(getattr(ds, "zero_stage", 3)), transport=opts.transport,
                                   timeout_s=opts.timeout_s, control_host=host, verify=opts.verify, name="openrlhf",
                                   delta=opts.delta, fanout=opts.fanout)

    def broadcast_to_vllm(self) -> Any:
        """Every rank writes its own ZeRO partitions into every engine; returns the SyncResult
        (OpenRLHF ignores it). The engines serve the new version when this returns on rank 0."""
        if self._fastsync_uses_openrlhf_path():
            return super().broadcast_to_vllm()
        import torch.distributed as dist

        if getattr(self, "_fastsync_sync", None) is None:
            self._fastsync_sync = self._fastsync_build()
            self._fastsync_sync.setup()
        result = self._fastsync_sync.sync()
        if dist.get_rank() == 0 and getattr(self.strategy.args.vllm, "enable_prefix_caching", False):
            # cached KV is of the old weights
            ray_result([e.reset_prefix_cache.remote() for e in self.vllm_engines], self._fastsync_options().timeout_s,
                       "vLLM engines: reset_prefix_cache")
        dist.barrier()
        return result


def _actor_with_moe(backend: str) -> Any:
    """OpenRLHF's ``Actor`` constructor followed by fastsync's MoE swap of its HF model, built
    partitioned under ZeRO-3 (before ``strategy.prepare`` wraps it: ``fastsync.moe.partitioned``)."""

    def build(*args: Any, **kwargs: Any) -> Any:
        actor = _OriginalActor(*args, **kwargs)
        actor.fastsync_moe_swapped = patch_moe_partitioned(actor.model, backend)
        return actor

    build._fastsync_moe = backend  # type: ignore[attr-defined]
    return build


def install_trainer(args: Any) -> FastSyncOptions:
    """Inside a trainer worker: rebind ``ppo_actor.ActorPPOTrainer`` (and ``ppo_actor.Actor``
    with ``--fastsync.moe``) before OpenRLHF instantiates them. Idempotent."""
    opts = options_from_args(args)
    ppo_actor.ActorPPOTrainer = FastSyncActorPPOTrainer
    ppo_actor.Actor = _actor_with_moe(opts.moe) if opts.moe != "off" else _OriginalActor
    return opts


_PolicyBase: type = getattr(ppo_actor.PolicyModelActor, "__ray_actor_class__", ppo_actor.PolicyModelActor)


class FastSyncPolicyModel(_PolicyBase):  # type: ignore[misc, valid-type]
    """OpenRLHF's ``PolicyModelActor`` class; installs the trainer subclass in its own worker."""

    def init_model_from_pretrained(self, strategy: Any, pretrain: str, max_steps: Any = None,
                                   vllm_engines: Any = None) -> Any:
        install_trainer(strategy.args)
        return super().init_model_from_pretrained(strategy, pretrain, max_steps=max_steps, vllm_engines=vllm_engines)

    def fastsync_openrlhf_report(self) -> dict:
        """This worker's process and which trainer class OpenRLHF's module now names."""
        cls = ppo_actor.ActorPPOTrainer
        trainer = getattr(self, "trainer", None)
        return {"pid": os.getpid(), "ActorPPOTrainer": f"{cls.__module__}.{cls.__qualname__}",
                "trainer": None if trainer is None else type(trainer).__qualname__}


#: What ``hooks.install`` binds as ``openrlhf.trainer.ray.ppo_actor.PolicyModelActor``.
FastSyncPolicyModelActor = ray.remote(num_gpus=1)(FastSyncPolicyModel)
