"""Which path a session takes, and the trainer side of the in-place path.

Per session (``fastsync_verl.session``), before anything is planned:

* every rollout rank publishes whether it can receive in place (``rollout/{rank}/mode``): only
  when its weights go to verl's vLLM ``ServerAdapter`` (hooked by ``fastsync_verl.server``) on a
  server running the composed extension (``fastsync_verl.server.capability``); the replica
  leader also says how many engine workers it drives and the newest version its engine served
  or began (``held``: engines outlive sessions and their versions only grow);
* trainer rank 0 decides for everybody (``mode``): in place when every rollout rank can and the
  trainer ranks send from their FSDP2 shards; otherwise the full-tensor path (every rollout rank
  receives verl's tensors in its own buffers and verl loads them), logged with the reason, or a
  ConfigError under ``engine_kwargs.fastsync.inplace=on``. In place it also names the session's
  first version: the one the master handed out, or one above every engine's ``held`` where that
  is higher (a new master, e.g. another trainer job or backend options, meeting servers an earlier
  one synced). Every rank takes it (``FastSyncCheckpointEngine.adopt_version``), so the master
  counts on from there.

In place, the trainer ranks run fastsync's :class:`fastsync.WeightSync` over their own shard
buffers: trainer rank 0 holds one ``fastsync.RemoteEngine`` per replica leader, whose requests
the leader answers by driving verl's server (``fastsync_verl.server.ServerEngine``). The plan is
built from the engine workers' own description of their live tensors (fused ``qkv_proj``,
``gate_up_proj``, TP slices), so the writes land in the live engine weights.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import torch

from fastsync import ConfigError, RemoteEngine, TrainerLayout, WeightSync

__all__ = ["MODE_KEY", "INPLACE_MODES", "rollout_mode_key", "publish_rollout_mode", "decide_mode", "read_mode",
           "InplaceTrainer"]

log = logging.getLogger("fastsync_verl")

MODE_KEY = "mode"
INPLACE_MODES = ("auto", "on", "off")


def rollout_mode_key(rank: int) -> str:
    return f"rollout/{rank}/mode"


def engine_id(rollout_rank: int) -> str:
    return f"rollout{rollout_rank}"


def publish_rollout_mode(ctl: Any, rank: int, inplace: bool, why: str, leader: bool, workers: int,
                         held: int = 0) -> None:
    ctl.set(rollout_mode_key(rank), json.dumps({"inplace": inplace, "why": why, "leader": leader, "workers": workers,
                                                "held": held}))


def decide_mode(ctl: Any, num_receivers: int, trainer_why: str | None, policy: str, timeout_s: float,
                version: int) -> dict:
    """Trainer rank 0: read every rollout rank's capability, decide, publish; returns the decision
    (``mode``, ``why``, ``leaders``, and ``version``: this sync's version, above every engine's
    ``held`` in place)."""
    ranks = [json.loads(ctl.get(rollout_mode_key(r), timeout_s, what=f"rollout rank {r} (in-place capability)"))
             for r in range(num_receivers)]
    why = ""
    if policy == "off":
        why = "engine_kwargs.fastsync.inplace='off'"
    elif trainer_why is not None:
        why = f"trainer ranks send verl's full tensors ({trainer_why})"
    else:
        bad = [(r, m["why"]) for r, m in enumerate(ranks) if not m["inplace"]]
        if bad:
            why = f"rollout rank {bad[0][0]}: {bad[0][1]}"
        elif not any(m["leader"] for m in ranks):
            why = "no rollout rank holds a server handle (replica leader)"
    leaders = [[r, int(m["workers"])] for r, m in enumerate(ranks) if m["inplace"] and m["leader"]]
    if not why and sum(w for _, w in leaders) != num_receivers:
        why = (f"the replica leaders drive {sum(w for _, w in leaders)} engine workers, verl lists "
               f"{num_receivers} rollout ranks")
    if not why:  # the engines outlive this session: its versions start above what any of them holds
        version = max([version] + [int(m.get("held", 0)) + 1 for m in ranks if m["leader"]])
    decision = {"mode": "fulltensor" if why else "inplace", "why": why, "leaders": leaders, "version": version}
    if why and policy == "on":
        ctl.set(MODE_KEY, json.dumps({**decision, "mode": "error"}))
        raise ConfigError(f"engine_kwargs.fastsync.inplace='on' but the in-place path cannot serve: {why}")
    ctl.set(MODE_KEY, json.dumps(decision))
    if why:
        log.warning("fastsync: full-tensor path for this session (rollout ranks receive verl's tensors and verl "
                    "loads them): %s", why)
    else:
        log.info("fastsync: in-place path: writes land in the live vLLM weights of %d replica(s)", len(leaders))
    return decision


def read_mode(ctl: Any, timeout_s: float, who: str) -> dict:
    got = json.loads(ctl.get(MODE_KEY, timeout_s, what=f"trainer rank 0 (session path), for {who}"))
    if got["mode"] == "error":
        raise ConfigError(f"{who}: trainer rank 0 refused the session: {got['why']}")
    return got


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
