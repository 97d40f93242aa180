"""Trainer side: sync a DeepSpeed model's weights into OpenRLHF's vLLM engines with fastsync.

OpenRLHF gathers every parameter whole on every rank (``GatheredParameters``) and rank 0 alone
broadcasts it, one ``ray.get`` per parameter. Here the plan is built once from DeepSpeed's own
partitioning (the module describes itself to ``WeightSync``: ZeRO-3's ``ds_tensor`` slices, or
whole parameters below stage 3) and every rank WRITEs its own bytes straight into the engines' live weights (NIXL);
nothing is gathered. On every DeepSpeed rank, after ``optimizer.step()``::

    sync = DeepSpeedWeightSync(actor.model.module, engines=vllm_engines, zero_stage=3)
    sync.setup()        # once (collective): layouts, plan, memory registration
    sync.sync()         # every step: version 1, 2, ...; engines flip when every write landed
    sync.close()

Nothing here imports OpenRLHF or DeepSpeed. The engines are ``FastSyncRolloutRayActor`` handles
(:func:`RayEngine` wraps them).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from fastsync_openrlhf._fastsync import (
    RpcEngine,
    node_address,
    share_over_torch,
    ConfigError,
    LayoutError,
    WeightSync,
)

__all__ = ["RayEngine", "DeepSpeedWeightSync"]

log = logging.getLogger(__name__)


def RayEngine(actor: Any, *, index: int, control_host: str, timeout_s: float) -> RpcEngine:
    """fastsync's engine handle (what ``WeightSync`` drives) for one ``FastSyncRolloutRayActor``:
    the host kit's ``RpcEngine`` over Ray actor calls. ``control_host`` is added to the connect
    options (the engine's workers join trainer rank 0's control plane there)."""
    return RpcEngine.over_ray(actor, name=f"vLLM engine {index}", timeout_s=timeout_s,
                              connect_options={"control_host": control_host})


class DeepSpeedWeightSync:
    """One DeepSpeed rank's end of the sync (see module doc). ``engines``: the rollout actors
    (every rank may hold them; only rank 0 drives them). ``control_host``: where trainer rank 0
    serves the control plane (default: Ray's node IP, 127.0.0.1 without Ray)."""

    def __init__(self, module: torch.nn.Module, *, engines: list, zero_stage: int, transport: str = "nixl",
                 timeout_s: float = 120.0, control_host: str | None = None, verify: bool = False,
                 name: str = "openrlhf", delta: bool = False, fanout: str = "off") -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise ConfigError("DeepSpeedWeightSync needs DeepSpeed's torch.distributed group (init it first)")
        if not engines:
            raise ConfigError("DeepSpeedWeightSync: no vLLM engines to sync into (--vllm.num_engines 0?)")
        if zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"--ds.zero_stage must be 0-3, got {zero_stage}")  # before any rank plans
        self.module = module
        self.engines = list(engines)
        self.zero_stage = zero_stage
        self.transport = transport
        self.timeout_s = timeout_s
        self.verify = verify
        self.delta, self.fanout = delta, fanout
        self.name = name
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.control_host = control_host or node_address()
        self.control: Any = None
        self.ws: WeightSync | None = None
        self.version = 0
        self._ptrs: dict[str, int] = {}
        self._setups = 0
        self.setup_s = 0.0

    def _pointers(self) -> dict[str, int]:
        """Where each parameter's local bytes live (under ZeRO-3 its partition, ``ds_tensor``);
        LayoutError naming the first parameter that does not match ``zero_stage``."""
        out = {}
        for n, p in self.module.named_parameters():
            if hasattr(p, "ds_tensor") != (self.zero_stage == 3):
                raise LayoutError(f"trainer rank {self.rank}: parameter {n!r} is {'' if hasattr(p, 'ds_tensor') else 'not '}"
                                  f"a ZeRO-3 partition under --ds.zero_stage {self.zero_stage}")
            out[n] = getattr(p, "ds_tensor", p).data_ptr()
        return out

    def _control(self) -> Any:
        """Trainer rank 0 serves fastsync's control store; its port and the job secret reach the
        other ranks over DeepSpeed's own process group (the job's channel), and the engines in
        ``WeightSync``'s connect options (over Ray)."""
        if self.control is None:
            self.control = share_over_torch(self.rank, host=self.control_host, timeout_s=self.timeout_s)
        return self.control

    def setup(self) -> None:
        """Collective, on every rank: plan from the live partitions and register them. Raises
        (before any write) when the trainer's parameters and the engines' disagree."""
        t0 = time.perf_counter()
        control = self._control()
        self._ptrs = self._pointers()
        self._setups += 1
        name = f"{self.name}{self._setups}"
        handles = [RayEngine(a, index=i, control_host=self.control_host, timeout_s=self.timeout_s)
                   for i, a in enumerate(self.engines)] if self.rank == 0 else []
        old = self.ws
        # the module describes itself (fastsync_trainer_layout): zero3:N partitions, or whole parameters
        ws = WeightSync(self.module, rank=self.rank, world_size=self.world_size, control=control.with_prefix(name),
                        engines=handles, transport=self.transport, timeout_s=self.timeout_s, name=name,
                        control_port=control.port, verify=self.verify, delta=self.delta, fanout=self.fanout)
        if old is not None:
            old.close()
        ws.setup()
        self.ws = ws
        self.setup_s = time.perf_counter() - t0
        log.info("fastsync: trainer rank %d planned ZeRO-%d (%d transfers) in %.2f s", self.rank, self.zero_stage,
                 len(ws.plan.transfers) if ws.plan else 0, self.setup_s)

    def _moved(self) -> bool:
        """Whether DeepSpeed moved any partition since set-up (e.g. offloaded and reloaded),
        agreed on by every rank (the registered memory would no longer be the weights)."""
        import torch.distributed as dist

        got: list = [None] * self.world_size
        dist.all_gather_object(got, self._pointers() != self._ptrs)
        return any(got)

    def sync(self, version: int | None = None) -> Any:
        """Write the current weights as ``version`` (default: the next one; every rank, same
        value). Re-plans first when DeepSpeed moved a partition since the last set-up."""
        if self.ws is None:
            self.setup()
        elif self._moved():
            log.info("fastsync: DeepSpeed moved parameter partitions since set-up; re-registering")
            self.setup()
        self.version = self.version + 1 if version is None else version
        return self.ws.sync(self.version)  # type: ignore[union-attr]

    def close(self) -> None:
        if self.ws is not None:
            self.ws.close()
            self.ws = None
