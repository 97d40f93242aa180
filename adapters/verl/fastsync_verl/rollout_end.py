"""One verl rollout rank's end of a fastsync session (opened by ``FastSyncCheckpointEngine`` per
session).

verl's vLLM ``ServerAdapter`` (hooked by ``fastsync_verl.server``) calls :meth:`RolloutEnd.serve`:
the rank reports whether its server can be written in place, follows trainer rank 0's decision,
and either drives its server while the trainer ranks write into the live engine tensors (replica
leader) or takes the buffered full copy (``fastsync.host.fullcopy``) into verl's own loader. Any
other consumer iterates :meth:`RolloutEnd.receive_full`, verl's ``(name, tensor)`` stream.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from typing import Any

import torch

from fastsync import ConfigError, ControlPlane, FastSyncError, SyncError, serve_engine
from fastsync import FullCopyReceiver, publish_capability, read_path
from fastsync_verl.inplace import engine_id
from fastsync_verl.server import ServerEngine
from fastsync_verl.server import capability as server_capability

__all__ = ["RolloutEnd", "Receive"]


class RolloutEnd:
    """``owner``: the ``FastSyncCheckpointEngine`` (its options; its ``setups``, ``last_path``,
    ``last_stall_s``, ``last_paused_here`` are updated here; ``drop_session()`` when this
    session's requests or set-up went wrong)."""

    def __init__(self, owner: Any, *, rank: int, num_trainers: int, num_receivers: int,
                 control: ControlPlane) -> None:
        self.owner, self.rank, self.num_trainers, self.num_receivers = owner, rank, num_trainers, num_receivers
        self.control = control
        self.mode: dict | None = None
        self.receiver: FullCopyReceiver | None = None
        self._leader: tuple[bool, int] = (False, 0)  # in place: replica leader?, engine workers
        self._next_request = 1  # leader, in place: the next request number of this session

    async def _decide(self, ok: bool, why: str | None, leader: bool, workers: int, held: int = 0) -> None:
        o = self.owner
        if o.inplace == "off":
            ok, why = False, "engine_kwargs.fastsync.inplace='off'"
        publish_capability(self.control, self.rank, ok, why, leader, workers, held)
        if not ok and o.inplace == "on":
            raise ConfigError(f"fastsync rollout rank {self.rank}: engine_kwargs.fastsync.inplace='on' but: {why}")
        self.mode = await asyncio.to_thread(read_path, self.control, o.timeout_s * 4, f"rollout rank {self.rank}")
        self._leader = (leader, workers)

    async def serve(self, adapter: Any, fallback: Any, global_steps: int | None, version: int) -> Any:
        """The hooked ``ServerAdapter.update_weights`` (see module doc)."""
        o, rank = self.owner, self.rank
        if self.mode is None:
            ok, why, leader, workers = server_capability(adapter)
            held = 0
            if ok and leader and o.inplace != "off":  # the newest version the engine served or began
                try:
                    held = await asyncio.to_thread(self._engine(adapter, global_steps, workers).held)
                except FastSyncError as e:  # named where trainer rank 0 decides (fallback, or refused under 'on')
                    ok, why = False, f"its engine did not say which version it holds: {e}"
            await self._decide(ok, why, leader, workers, held)
        assert self.mode is not None
        version = o.adopt_version(max(version, int(self.mode["version"])))  # in place: above what engines hold
        o.last_path = self.mode["mode"]
        if self.mode["mode"] != "inplace":
            t0 = time.perf_counter()
            try:
                return await fallback(self.receive_full(version))  # verl's own load (generation paused by verl)
            finally:
                o.last_stall_s = time.perf_counter() - t0
        leader, workers = self._leader
        if not leader:
            return None  # this rank's engine worker is driven through its replica leader's server
        engine = self._engine(adapter, global_steps, workers)
        first = self._next_request
        try:
            last = await asyncio.to_thread(serve_engine, engine, self.control, engine_id=engine_id(rank),
                                           idle_timeout_s=o.timeout_s * 4, first=first)
        except BaseException:
            o.drop_session()  # requests of this session are out of step: open a fresh one
            raise
        self._next_request = last + 2
        o.last_stall_s = engine.last_stall_s
        o.last_drain_s = engine.last_drain_s
        o.last_phases = dict(engine.last_phases)
        o.last_paused_here = engine.last_paused_here
        if engine.last_version != version:
            raise SyncError(f"fastsync rollout rank {rank}: version {version} was not flipped in verl's server "
                            f"(it serves {engine.last_version}); the trainer ranks' error says why")
        if first == 1:
            o.setups += 1  # the session's first turn: describe and connect ran
        return None

    def _engine(self, adapter: Any, global_steps: int | None, workers: int) -> ServerEngine:
        """The handle on this replica leader's verl server."""
        o = self.owner
        if not adapter._ensure_server_handle():
            raise SyncError(f"fastsync rollout rank {self.rank}: verl's server adapter has no server handle")
        return ServerEngine(adapter.server_handle, self.control, engine_id=engine_id(self.rank), workers=workers,
                            timeout_s=o.timeout_s, global_steps=global_steps, pause_mode=o.pause_mode,
                            staged=o.staged)

    async def receive_full(self, version: int) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        """Land every trainer rank's writes, flip only when all arrived, then yield
        ``(name, tensor)`` in verl's order. The tensors are this rank's receive buffers: the
        consumer copies them (into vLLM) before the next sync overwrites them."""
        o = self.owner
        if self.mode is None:  # not verl's vLLM ServerAdapter: nothing to drive in place
            await self._decide(False, "the consumer of receive_weights is not verl's vLLM ServerAdapter "
                               "(SGLang, or another adapter)", False, 0)
            o.last_path = "fulltensor"
        if self.receiver is None:
            self.receiver = FullCopyReceiver(rank=self.rank, num_trainers=self.num_trainers,
                                             num_receivers=self.num_receivers, control=self.control,
                                             transport=o.transport, timeout_s=o.timeout_s,
                                             max_transfer_bytes=o.max_transfer_bytes, cap_bytes=o.bucket_size,
                                             verify=o.verify)
        rx = self.receiver
        if not rx.ready:
            await o.set_up(rx.setup)
        for item in await rx.receive(version):  # SyncError naming what did not land
            yield item

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()
        self.receiver = None


class Receive:
    """``receive_weights``' result: an async iterable of verl's tensors (full-copy path) that
    verl's hooked vLLM ``ServerAdapter`` serves in place instead (``fastsync_serve``)."""

    def __init__(self, end: RolloutEnd, global_steps: int | None, version: int) -> None:
        self._end, self._global_steps, self._version = end, global_steps, version

    def __aiter__(self) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        return self._end.receive_full(self._version)

    async def fastsync_serve(self, adapter: Any, fallback: Any) -> Any:
        return await self._end.serve(adapter, fallback, self._global_steps, self._version)
