"""The trainer side of a weight sync for a DeepSpeed job: every rank writes its own bytes (ZeRO-3:
its ``ds_tensor`` partitions; below stage 3 its share of the whole parameters, split by the
planner) straight into the engines' live weights; nothing is gathered. OpenRLHF's adapter runs
it; so can any loop that trains with DeepSpeed. On every rank, after ``optimizer.step()``::

    sync = DeepSpeedWeightSync(engine.module, engines=handles, zero_stage=3)  # handles: rank 0's
    sync.setup()        # once (collective): the module describes itself, plan, registration
    sync.sync()         # every step: version 1, 2, ...; engines flip when every write landed
    sync.close()

Trainer rank 0 serves the control store; its port and the job secret reach the other ranks over
DeepSpeed's own ``torch.distributed`` group (``share_over_torch``). A partition DeepSpeed moved
since set-up (offloaded and reloaded) is re-registered before the next sync, all ranks agreeing.
Nothing here imports DeepSpeed: only the parameters' ``ds_*`` attributes are read.

A PEFT LoRA module (OpenRLHF's ``--ds.lora.rank``) is sent merged, under the base checkpoint's
names, as an engine without LoRA serves it (``fastsync.host.lora_merge``): each rank merges the
current adapters into its own slice of every targeted weight before each sync (a collective: the
adapters are gathered); unsupported PEFT settings are refused by name at construction.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from fastsync.errors import ConfigError, LayoutError
from fastsync.host.control import node_address, share_over_torch
from fastsync.host.lora_merge import MergedLoraSources
from fastsync.sync.peft_sync import is_peft_model
from fastsync.sync.weight_sync import EngineHandle, SyncResult, WeightSync
from fastsync.executor.verify_mode import verify_mode

__all__ = ["DeepSpeedWeightSync"]

log = logging.getLogger("fastsync.host")


class DeepSpeedWeightSync:
    """One DeepSpeed rank's end of the sync (module doc). ``engines``: the engine handles (used on
    rank 0 only; e.g. ``RpcEngine.over_ray(actor, ..., connect_options={"control_host": host})``).
    ``control_host``: where trainer rank 0 serves the control plane (default: Ray's node IP,
    127.0.0.1 without Ray); the handles' workers must reach it."""

    def __init__(self, module: Any, *, engines: Sequence[EngineHandle], zero_stage: int, transport: str = "nixl",
                 timeout_s: float = 120.0, control_host: str | None = None, verify: bool | str = False,
                 name: str = "deepspeed", delta: bool = False, fanout: str = "off") -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise ConfigError("DeepSpeedWeightSync needs DeepSpeed's torch.distributed group (init it first)")
        if not engines:
            raise ConfigError("DeepSpeedWeightSync: no engines to sync into")
        if zero_stage not in (0, 1, 2, 3):
            raise ConfigError(f"DeepSpeedWeightSync: zero_stage must be 0-3, got {zero_stage}")
        self.module, self.engines, self.zero_stage = module, list(engines), zero_stage
        self.transport, self.timeout_s = transport, timeout_s
        self.verify = verify_mode(verify)
        self.delta, self.fanout, self.name = delta, fanout, name
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.control_host = control_host or node_address()
        # a PEFT policy goes merged; its refusals come here, before anything is planned
        self.merged = (MergedLoraSources(module, rank=self.rank, world_size=self.world_size)
                       if is_peft_model(module) else None)
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
                what = "a ZeRO-3 partition" if hasattr(p, "ds_tensor") else "not a ZeRO-3 partition"
                raise LayoutError(f"trainer rank {self.rank}: parameter {n!r} is {what}, but zero_stage is "
                                  f"{self.zero_stage}")
            out[n] = getattr(p, "ds_tensor", p).data_ptr()
        return out

    def setup(self) -> None:
        """Collective, on every rank: plan from the live partitions and register them. Raises
        (before any write) when the trainer's parameters and the engines' disagree."""
        t0 = time.perf_counter()
        if self.control is None:
            self.control = share_over_torch(self.rank, host=self.control_host, timeout_s=self.timeout_s)
        self._ptrs = self._pointers()
        self._setups += 1
        name = f"{self.name}{self._setups}"
        if self.ws is not None:
            self.ws.close()
            self.ws = None
        # the module describes itself (fastsync_trainer_layout): zero3:N partitions, or whole parameters;
        # a PEFT module is described by its merged view
        layout, sources = self.merged.plan() if self.merged is not None else (None, None)
        ws = WeightSync(None if self.merged is not None else self.module, layout=layout, sources=sources,
                        rank=self.rank, world_size=self.world_size, control=self.control.with_prefix(name),
                        engines=self.engines if self.rank == 0 else [], transport=self.transport,
                        timeout_s=self.timeout_s, name=name, control_port=self.control.port, verify=self.verify,
                        delta=self.delta, fanout=self.fanout)
        ws.setup()
        self.ws = ws
        self.setup_s = time.perf_counter() - t0
        log.info("fastsync: trainer rank %d planned ZeRO-%d (%d transfers) in %.2f s", self.rank, self.zero_stage,
                 len(ws.plan.transfers) if ws.plan else 0, self.setup_s)

    def _moved(self) -> bool:
        """Whether DeepSpeed moved any partition since set-up, agreed on by every rank (the
        registered memory would no longer be the weights)."""
        import torch.distributed as dist

        got: list = [None] * self.world_size
        dist.all_gather_object(got, self._pointers() != self._ptrs)
        return any(got)

    def sync(self, version: int | None = None) -> SyncResult:
        """Write the current weights as ``version`` (default: the next one; every rank, same
        value). Re-plans first when DeepSpeed moved a partition since the last set-up."""
        if self.ws is None:
            self.setup()
        elif self._moved():
            log.info("fastsync: DeepSpeed moved parameter partitions since set-up; re-registering")
            self.setup()
        self.version = self.version + 1 if version is None else version
        assert self.ws is not None
        if self.merged is not None:
            self.merged.refresh()  # collective: this version's adapters merged into the staging slices
        return self.ws.sync(self.version)

    def close(self) -> None:
        if self.ws is not None:
            self.ws.close()
            self.ws = None
