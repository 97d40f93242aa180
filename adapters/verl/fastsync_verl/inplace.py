"""The trainer side of verl's in-place path. Which path a session takes is decided by trainer rank
0 with the host kit (``fastsync.host.path_choice``, policy ``engine_kwargs.fastsync.inplace``): in
place when every rollout rank's weights go to verl's vLLM ``ServerAdapter`` (hooked by
``fastsync_verl.server``) on a server running the composed extension
(``fastsync_verl.server.capability``) and the trainer ranks send from their FSDP2 shards. The
session's first version is above what every engine holds; every rank takes it
(``FastSyncCheckpointEngine.adopt_version``), so the master counts on from there.

In place, the trainer ranks run fastsync's :class:`fastsync.WeightSync` over their own shard
buffers: trainer rank 0 holds one ``fastsync.RemoteEngine`` per replica leader, whose requests
the leader answers by driving verl's server (``fastsync_verl.server.ServerEngine``). The plan is
built from the engine workers' own description of their live tensors (fused ``qkv_proj``,
``gate_up_proj``, TP slices), so the writes land in the live engine weights.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from fastsync import PATH_POLICIES as INPLACE_MODES
from fastsync import RemoteEngine, TrainerLayout, WeightSync

__all__ = ["INPLACE_MODES", "POLICY_KEY", "engine_id", "InplaceTrainer"]

log = logging.getLogger("fastsync_verl")

POLICY_KEY = "engine_kwargs.fastsync.inplace"


def engine_id(rollout_rank: int) -> str:
    return f"rollout{rollout_rank}"


class InplaceTrainer:
    """One trainer rank's :class:`fastsync.WeightSync` into verl's live vLLM servers."""

    def __init__(self, *, rank: int, num_trainers: int, control: Any, leaders: list[list[int]],
                 layout: TrainerLayout, sources: dict[str, torch.Tensor], transport: str, timeout_s: float,
                 verify: bool, delta: bool = False, fanout: str = "off", pause_mode: str = "abort",
                 staged: bool = False) -> None:
        self.rank = rank
        self.engines = ([RemoteEngine(control, engine_id=engine_id(r), timeout_s=timeout_s) for r, _ in leaders]
                        if rank == 0 else [])
        self.ws = WeightSync(layout=layout, sources=sources, rank=rank, world_size=num_trainers, control=control,
                             engines=self.engines, transport=transport, timeout_s=timeout_s, verify=verify,
                             name="inplace", delta=delta, fanout=fanout, pause_mode=pause_mode,
                             staged=staged)
        self.ready = False
        self.last_engines: list[list[dict]] = []
        self.last_fallback: dict = {}  # trainer rank 0: what the engines took through vLLM's load_weights

    def sync(self, version: int) -> dict:
        """Set up on the first call (describe, plan, connect), then write ``version``. Trainer rank
        0 ends every leader's turn (``stop``) whatever happened, so no rollout rank waits out
        its deadline."""
        try:
            if not self.ready:
                self.ws.setup()
                self.ready = True
            res = self.ws.sync(version)
            self.last_engines = res.engines
            self.last_fallback = res.fallback if self.rank == 0 else {}
            return res.metrics
        finally:
            for e in self.engines:
                try:
                    e.stop()
                except Exception as err:  # noqa: BLE001 - the sync's own error is the one to raise
                    log.warning("fastsync: could not end %s's turn: %s", e.engine_id, err)

    def close(self) -> None:
        self.ws.close()
        self.ready = False
