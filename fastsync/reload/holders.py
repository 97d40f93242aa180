"""Trainer ranks as reload holders: a joining engine filled straight from the trainer's shards.

:class:`TrainerHolder` is the trainer job's side of :class:`~fastsync.reload.coordinator.PeerReload`
for ranks that live in the coordinator's process (threads, as in the tests and the bench): it
runs one :class:`~fastsync.sync.sender.WeightSender` per trainer rank against the joining
engine's plan. Ranks in other processes run the same ``reload_send`` on their own rank (the
options say which source ranks they are: ``rank_offset + rank``).
"""

from __future__ import annotations

import threading

import torch

from fastsync.errors import ConfigError, SyncError
from fastsync.layout.types import TrainerLayout
from fastsync.plan.types import Plan
from fastsync.sync.connect_options import ReloadSendOptions
from fastsync.sync.sender import WeightSender

__all__ = ["TrainerHolder"]


class TrainerHolder:
    """``TrainerHolder("trainer", layout, sources, version=lambda: step)``: ``sources[r]`` is
    trainer rank r's local buffers (as for ``WeightSender``); ``version`` says which weight
    version they hold now (a callable, so a live training loop can answer)."""

    def __init__(self, name: str, layout: TrainerLayout, sources: list[dict[str, torch.Tensor]], *,
                 version: object) -> None:
        if len(sources) != layout.world_size:
            raise ConfigError(f"TrainerHolder {name!r}: {len(sources)} source dicts for {layout.world_size} ranks")
        self.name = name
        self.layout = layout
        self.sources = sources
        self._version = version

    @property
    def version(self) -> int:
        return int(self._version() if callable(self._version) else self._version)  # type: ignore[arg-type]

    def source_layout(self) -> TrainerLayout:
        return self.layout

    def reload_send(self, plan_json: str, options: dict) -> list[dict]:
        opts = ReloadSendOptions.parse(options)
        want = opts.weight_version
        if self.version != want:
            raise SyncError(f"holder {self.name} holds version {self.version}, the joining engine asked for {want}: "
                            "refused (versions are never mixed)")
        plan = Plan.loads(plan_json)
        offset = opts.rank_offset
        out: list = [None] * self.layout.world_size

        def send(r: int) -> None:
            control = opts.control()
            shards = {n: [type(s)(s.rank + offset, s.box, s.local_offset) for s in ss]
                      for n, ss in self.layout.shards_on(r).items()}
            tx = WeightSender(rank=offset + r, plan=plan, sources=self.sources[r], shards=shards, control=control,
                              transport="nixl", timeout_s=opts.timeout_s)
            try:
                tx.setup()
                m = tx.sync(opts.handshake_version)
                out[r] = {"rank": offset + r, "send_s": m.end - m.start,
                          "registration": getattr(tx.transport, "registration", {})}
            except BaseException as e:
                out[r] = e
            finally:
                tx.close()

        threads = [threading.Thread(target=send, args=(r,), daemon=True) for r in range(self.layout.world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(opts.timeout_s + 30)
        for r in out:
            if isinstance(r, BaseException):
                raise r
            if r is None:
                raise SyncError(f"holder {self.name}: a trainer rank did not finish sending")
        return out
