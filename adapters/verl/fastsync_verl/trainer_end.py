"""One verl actor rank's end of a fastsync session (``FastSyncCheckpointEngine`` opens one per
session and closes it when the session changes).

Trainer rank 0 decides the session's path once (``fastsync.host.path_choice``): **in place** (this
rank's FSDP2 shards, copied into one registered buffer, written by fastsync's ``WeightSync`` into
the live engine tensors of every replica) or **full copy** (fastsync's buffered full-copy
channel, ``fastsync.host.fullcopy``: from the local shards, or from verl's full tensors where
shards cannot serve; verl's own loader takes the copy on the rollout side).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import Any

import torch
from verl.workers.rollout.utils import ensure_async_iterator

from fastsync import ConfigError, ControlPlane, TrainerLayout, copy_local_shards, renamed_shard_layout
from fastsync import FullCopySender, decide_path, read_path, shard_views
from fastsync_verl.inplace import POLICY_KEY, InplaceTrainer
from fastsync_verl.lora_merge import MergedShards
from fastsync_verl.shards import ShardedWeights

__all__ = ["TrainerEnd"]

log = logging.getLogger("fastsync_verl")


class TrainerEnd:
    """``owner``: the ``FastSyncCheckpointEngine`` (its options; its counters ``setups``,
    ``full_tensor_syncs``, ``last_path``, ``last_metrics`` are updated here; ``drop_session()``
    after a failed set-up makes the next sync open a fresh session)."""

    def __init__(self, owner: Any, *, rank: int, num_trainers: int, num_receivers: int,
                 control: ControlPlane) -> None:
        self.owner, self.rank, self.num_trainers, self.num_receivers = owner, rank, num_trainers, num_receivers
        self.control = control
        self.mode: dict | None = None
        self.sender: FullCopySender | None = None
        self.inplace: InplaceTrainer | None = None
        self.sources: dict[str, torch.Tensor] = {}  # in place: this rank's shards, registered
        self._local_names: dict[str, str] = {}  # HF name -> state_dict name
        self.merged: MergedShards | None = None  # a merged LoRA actor's shards (lora.merge=True)

    async def send(self, weights: Iterable[tuple[str, torch.Tensor]], module: Any, why: str | None,
                   version: int) -> dict[str, float]:
        o, rank = self.owner, self.rank
        t0 = time.perf_counter()
        if self.mode is None:
            self.mode = await asyncio.to_thread(self._decide, why, version)
        version = o.adopt_version(max(version, int(self.mode["version"])))  # in place: above what engines hold
        o.last_path = self.mode["mode"]
        if module is not None and isinstance(weights, ShardedWeights) and weights.lora_merged:
            module = self._merged_shards(module)
        if self.mode["mode"] == "inplace":
            if module is None:
                raise ConfigError(f"fastsync trainer rank {rank}: trainer rank 0 chose the in-place path but this "
                                  f"rank cannot send from FSDP2 shards: {why}")
            return await self._send_inplace(module, version, t0)
        packed = weights.full_copy_refusal() if isinstance(weights, ShardedWeights) and module is not None else None
        if packed is not None:  # verl's loader takes the un-fused names: verl's own export feeds this path
            if o.trainer_shards == "on":
                raise ConfigError(f"fastsync trainer rank {rank}: engine_kwargs.fastsync.trainer_shards='on' but the "
                                  f"session takes the full-copy path, which the local shards cannot feed: {packed}")
            if self.sender is None:
                log.warning("fastsync trainer rank %d: full-copy path from verl's full tensors: %s", rank, packed)
            module = None
        tx = self._full_copy_sender()
        if module is not None:
            if tx.plan is None:
                tx.plan_shards(self._layout(module))
            self._copy_shards(module, tx.sources)
        else:
            if tx.sharded:
                raise ConfigError(f"fastsync trainer rank {rank}: this session was planned from FSDP2 shards and verl "
                                  "now hands full tensors; set engine_kwargs.fastsync.trainer_shards consistently")
            o.full_tensor_syncs += 1
            tx.start_tensors()
            async for name, tensor in ensure_async_iterator(weights):
                tx.take(name, tensor)
            tx.end_of_tensors()
        if not tx.ready:
            await o.set_up(tx.setup)
        t1 = time.perf_counter()
        m = await asyncio.to_thread(tx.sync, version)
        return self._metrics(sum(m.bytes_per_link.values()), t0, t1, from_shards=module is not None)

    def _decide(self, why: str | None, version: int) -> dict:
        o = self.owner
        if self.rank == 0:
            return decide_path(self.control, self.num_receivers, why, o.inplace, o.timeout_s * 4, version,
                               policy_key=POLICY_KEY)
        return read_path(self.control, o.timeout_s * 4, f"trainer rank {self.rank}")

    async def _send_inplace(self, module: Any, version: int, t0: float) -> dict[str, float]:
        o = self.owner
        if self.inplace is None:
            layout = self._layout(module)
            _, self.sources = shard_views(layout, self.rank)
            assert self.mode is not None
            self.inplace = InplaceTrainer(rank=self.rank, num_trainers=self.num_trainers, control=self.control,
                                          leaders=self.mode["leaders"], layout=layout, sources=self.sources,
                                          transport=o.transport, timeout_s=o.timeout_s, verify=o.verify,
                                          delta=o.delta, fanout=o.fanout, pause_mode=o.pause_mode,
                                          staged=o.staged)
        self._copy_shards(module, self.sources)
        t1 = time.perf_counter()
        setting_up = not self.inplace.ready
        try:
            m = await asyncio.to_thread(self.inplace.sync, version)
        except BaseException:
            if setting_up:
                o.drop_session()  # the next sync opens a fresh session: every rank sets up again
            raise
        if setting_up:
            o.setups += 1
        sent = sum((m.get("bytes_per_link") or {}).values()) if isinstance(m, dict) else 0
        return self._metrics(sent, t0, t1, from_shards=True, inplace=True)

    def _metrics(self, sent: int, t0: float, t1: float, *, from_shards: bool, inplace: bool = False) -> dict:
        r = self.rank
        m = {f"fastsync/trainer{r}/sent_bytes": float(sent), f"fastsync/trainer{r}/collect_s": t1 - t0,
             f"fastsync/trainer{r}/send_s": time.perf_counter() - t1, f"fastsync/trainer{r}/from_shards": float(from_shards)}
        if inplace:
            m[f"fastsync/trainer{r}/inplace"] = 1.0
        if from_shards and self.merged is not None:  # the adapters' A (and B where needed), never a base weight
            m[f"fastsync/trainer{r}/lora_gathered_bytes"] = float(self.merged.adapter_gathered_bytes)
        self.owner.last_metrics = m
        return m

    def _full_copy_sender(self) -> FullCopySender:
        o = self.owner
        if self.sender is None:
            self.sender = FullCopySender(rank=self.rank, num_trainers=self.num_trainers,
                                         num_receivers=self.num_receivers, control=self.control,
                                         transport=o.transport, timeout_s=o.timeout_s,
                                         max_transfer_bytes=o.max_transfer_bytes, cap_bytes=o.bucket_size,
                                         verify=o.verify, staging_bytes=o.staging_bytes)
        return self.sender

    def _merged_shards(self, module: Any) -> MergedShards:
        """A PEFT LoRA actor's shards with the adapter merged on this rank (verl's lora.merge=True),
        built once per session."""
        if self.merged is None or self.merged.model is not module:
            self.merged = MergedShards(module, self.rank, self.num_trainers)
        return self.merged

    def _layout(self, module: Any) -> TrainerLayout:
        """The trainer layout from the DTensor placements under verl's HF names; remembers which
        state_dict entry holds each local shard."""
        names = module.hf_names() if isinstance(module, MergedShards) else ShardedWeights(None, module).hf_names()
        layout, self._local_names = renamed_shard_layout(
            module, self.rank, self.num_trainers, names,
            description="FSDP2 DTensor shards handed over by verl's actor ranks"
            + (", LoRA merged on each rank" if isinstance(module, MergedShards) else ""))
        return layout

    def _copy_shards(self, module: Any, sources: dict[str, torch.Tensor]) -> None:
        if isinstance(module, MergedShards):  # base shards, then each LoRA layer's delta rows (gathers A)
            module.copy_local(self._local_names, sources)
        else:
            copy_local_shards(module, self._local_names, sources, self.rank)

    def close(self) -> None:
        for end in (self.sender, self.inplace):
            if end is not None:
                end.close()
        self.sender = self.inplace = None
