"""The buffered full-copy channel: a host's fallback path when the engine's live weights cannot
be written in place. Every trainer rank WRITEs its share of the bytes (its own shards, or about
1/N of full tensors the host handed it) into every receiver rank's registered buffer; the
receiver hands the host ``(name, tensor)`` in the host's order once every write landed, and the
host loads them its own way (e.g. vLLM's ``load_weights``).

Plan (``fullcopy_plan``), registered buffers and connections are built once per session and
replayed every sync. Trainer rank 0 publishes the inventory under ``inventory`` on the session's
control plane; receivers plan from it, so both sides plan identically. Per sync::

    tx = FullCopySender(rank=r, num_trainers=N, num_receivers=R, control=ctl)   # once
    tx.start_tensors(); for name, t in full_tensors: tx.take(name, t)   # or plan_shards + fill tx.sources
    tx.end_of_tensors()                              # first sync: plans, sets up
    tx.sync(version)

    rx = FullCopyReceiver(rank=r, num_trainers=N, num_receivers=R, control=ctl)
    rx.setup(); rx.begin(version); while not rx.poll(): ...; rx.finish(); rx.named_tensors()
"""

from __future__ import annotations

import asyncio
import time

from typing import Any

import torch

from fastsync.control import ControlPlane
from fastsync.errors import ConfigError
from fastsync.host.fullcopy_plan import (FullCopyPlan, build_full_copy_plan, flat_views, inventory_from_json,
                                         inventory_of, send_boxes, shard_views)
from fastsync.layout.box import box_shape, box_slices
from fastsync.layout.types import Box, Shard, TrainerLayout
from fastsync.sync.receiver import WeightReceiver
from fastsync.sync.sender import WeightSender
from fastsync.executor.verify_mode import verify_mode

__all__ = ["FullCopySender", "FullCopyReceiver", "INVENTORY_KEY"]

INVENTORY_KEY = "inventory"


class _Channel:
    def __init__(self, *, rank: int, num_trainers: int, num_receivers: int, control: ControlPlane,
                 transport: str = "nixl", timeout_s: float = 120.0, max_transfer_bytes: int | None = None,
                 cap_bytes: int | None = None, verify: bool | str = False) -> None:
        self.rank, self.num_trainers, self.num_receivers = rank, num_trainers, num_receivers
        self.control, self.transport, self.timeout_s = control, transport, timeout_s
        self.verify = verify_mode(verify)
        self.max_transfer_bytes, self.cap_bytes = max_transfer_bytes, cap_bytes
        self.plan: FullCopyPlan | None = None
        self._flats: list[torch.Tensor] = []

    def _build(self, inventory: list, shards: dict | None = None) -> FullCopyPlan:
        self.plan = build_full_copy_plan(inventory, self.num_trainers, self.num_receivers, self.max_transfer_bytes,
                                         self.cap_bytes, shards=shards)
        return self.plan


class FullCopySender(_Channel):
    """One trainer rank's end. ``sources`` (name -> this rank's registered region of it) is what
    the host fills on the shard path; on the full-tensor path :meth:`take` fills it."""

    def __init__(self, *, staging_bytes: int = 64 << 20, **kw: Any) -> None:
        super().__init__(**kw)
        self.staging_bytes = staging_bytes
        self.sources: dict[str, torch.Tensor] = {}
        self.boxes: dict[str, Box] = {}
        self._sender: WeightSender | None = None
        self._held: dict[str, torch.Tensor] = {}  # first sync, full tensors: one host copy, until planned
        self._inventory: list = []
        self._taken = 0

    @property
    def ready(self) -> bool:
        return self._sender is not None

    @property
    def sharded(self) -> bool:
        return self.plan is not None and self.plan.sharded

    def plan_shards(self, trainer: TrainerLayout) -> dict[str, torch.Tensor]:
        """Plan from the trainer's own shards (one box per parameter on this rank); returns the
        registered views the host copies its local shards into before every :meth:`sync`."""
        self.boxes, self.sources = shard_views(trainer, self.rank)
        inventory = [(n, p.shape, p.dtype) for n, p in trainer.params.items()]
        self._build(inventory, shards=dict(trainer.shards))
        return self.sources

    def start_tensors(self) -> None:
        """Before the host's first :meth:`take` of a sync: forget a stream an earlier, failed sync
        left half-read."""
        self._taken = 0
        if self.plan is None:
            self._held, self._inventory = {}, []

    def take(self, name: str, tensor: torch.Tensor) -> None:
        """One of the host's full tensors, in the host's order: held (first sync) or its share
        copied into the registered buffer (later syncs, checked against the planned inventory)."""
        got = inventory_of(name, tensor)
        if self.plan is None:
            self._inventory.append(got)
            self._held[name] = tensor.detach().to("cpu", copy=True)
            return
        if self.plan.sharded:
            raise ConfigError(f"fastsync trainer rank {self.rank}: this session was planned from the trainer's shards "
                              "and the host now hands full tensors; choose one path per session")
        inventory, i = self.plan.inventory, self._taken
        if i >= len(inventory) or got != inventory[i]:
            want = inventory[i] if i < len(inventory) else "nothing more"
            raise ConfigError(f"fastsync trainer rank {self.rank}: the host sent {got} where the plan expects {want}; "
                              "the model changed since the first sync (re-plan by restarting the backend)")
        self._taken += 1
        dst = self.sources.get(name)
        if dst is not None:
            dst.copy_(tensor.detach()[box_slices(self.boxes[name])])

    def end_of_tensors(self) -> None:
        """After the last :meth:`take`: plan and carve on the first sync (keeping only this rank's
        regions), or check that every planned tensor came."""
        if self.plan is None:
            plan = self._build(self._inventory)
            self.boxes = send_boxes(plan.plan, self.rank)
            dtypes = {n: d for n, _, d in self._inventory}
            self._flats, self.sources = flat_views([(n, box_shape(b), dtypes[n]) for n, b in self.boxes.items()])
            for name, box in self.boxes.items():
                self.sources[name].copy_(self._held[name][box_slices(box)])
            self._held, self._inventory = {}, []
            return
        n, inventory, self._taken = self._taken, self.plan.inventory, 0
        if n != len(inventory):
            raise ConfigError(f"fastsync trainer rank {self.rank}: the host sent {n} of the {len(inventory)} planned "
                              f"tensors; first missing {inventory[n][0]!r}")

    def setup(self) -> None:
        """Publish the inventory (rank 0) and set up this rank's sender over :attr:`sources`;
        on failure the sender is closed and the error raised (the host opens a fresh session)."""
        if self.plan is None:
            raise ConfigError(f"fastsync trainer rank {self.rank}: setup() before the plan (take/end_of_tensors or "
                              "plan_shards first)")
        if self.rank == 0:
            self.control.set(INVENTORY_KEY, self.plan.to_json())
        sender = WeightSender(rank=self.rank, plan=self.plan.plan, sources=self.sources,
                              shards={n: [Shard(self.rank, b, 0)] for n, b in self.boxes.items()}, control=self.control,
                              transport=self.transport, staging_bytes=self.staging_bytes, timeout_s=self.timeout_s)
        try:
            sender.setup()
        except BaseException:
            sender.close()
            raise
        self._sender = sender

    def sync(self, version: int) -> Any:
        if self._sender is None:
            raise ConfigError(f"fastsync trainer rank {self.rank}: sync({version}) before setup()")
        return self._sender.sync(version, verify=self.verify or None)

    def close(self) -> None:
        if self._sender is not None:
            self._sender.close()
        self._sender = None


class FullCopyReceiver(_Channel):
    """One receiver rank's end: a full copy of every tensor in its registered buffer."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.tensors: dict[str, torch.Tensor] = {}
        self._receiver: WeightReceiver | None = None

    @property
    def ready(self) -> bool:
        return self._receiver is not None

    def setup(self) -> None:
        """Read trainer rank 0's inventory (with a deadline), plan, carve, set up the receiver."""
        raw = self.control.get(INVENTORY_KEY, self.timeout_s, f"trainer rank 0 (inventory), for receiver rank {self.rank}")
        inventory, shards = inventory_from_json(raw)
        plan = self._build(inventory, shards)
        self._flats, self.tensors = flat_views(plan.inventory)
        rx = WeightReceiver(rank=self.rank, plan=plan.plan, tensors=self.tensors, control=self.control,
                            transport=self.transport, mode="inplace", verify=self.verify,
                            engine_hash=plan.engine.fingerprint(), timeout_s=self.timeout_s)
        try:
            rx.setup()
        except BaseException:
            rx.close()
            raise
        self._receiver = rx

    def _rx(self) -> WeightReceiver:
        if self._receiver is None:
            raise ConfigError(f"fastsync receiver rank {self.rank}: used before setup()")
        return self._receiver

    async def receive(self, version: int) -> list[tuple[str, torch.Tensor]]:
        """Land every trainer rank's writes of ``version`` (the host's event loop keeps running),
        flip when all arrived, and return ``(name, tensor)`` in the host's order: this rank's
        buffers, which the host copies before the next sync. SyncError naming the missing
        trainer ranks and tensors when some did not land by the deadline."""
        rx = self._rx()
        rx.begin(version)
        deadline = time.monotonic() + self.timeout_s
        while not rx.poll() and time.monotonic() < deadline:
            await asyncio.sleep(0.001)
        rx.finish()
        assert self.plan is not None
        return [(name, self.tensors[name]) for name, _, _ in self.plan.inventory]

    def close(self) -> None:
        if self._receiver is not None:
            self._receiver.close()
        self._receiver = None
