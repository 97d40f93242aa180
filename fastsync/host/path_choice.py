"""Which path a session takes: in place (the trainer ranks write into the live engine tensors)
or the buffered full copy (``fastsync.host.fullcopy``: the host's own loader takes the tensors),
decided once per session by trainer rank 0 for everybody, before anything is planned.

* every rollout rank publishes whether it can receive in place (:func:`publish_capability`);
  a replica leader also says how many engine workers it drives and the newest version its
  engine served or began (``held``: engines outlive sessions and their versions only grow);
* trainer rank 0 decides (:func:`decide_path`): in place when every rollout rank can and the
  trainer ranks send from their shards; otherwise the full copy, logged with the reason, or a
  ConfigError naming the host's policy key under ``on``. In place it also names the session's
  first version: the one the master handed out, or one above every engine's ``held`` where that
  is higher (a new master meeting engines an earlier one synced);
* everybody else reads the decision (:func:`read_path`), a refusal included, never a timeout.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from fastsync.errors import ConfigError
from fastsync.protocol import rollout_mode_key

__all__ = ["MODE_KEY", "PATH_POLICIES", "publish_capability", "decide_path", "read_path"]

log = logging.getLogger("fastsync.host")

MODE_KEY = "mode"
#: the host's policy: ``auto`` (in place where every side can), ``on`` (in place or refuse), ``off``
PATH_POLICIES = ("auto", "on", "off")


def publish_capability(ctl: Any, rank: int, inplace: bool, why: str, leader: bool, workers: int,
                       held: int = 0) -> None:
    ctl.set(rollout_mode_key(rank), json.dumps({"inplace": inplace, "why": why, "leader": leader, "workers": workers,
                                                "held": held}))


def decide_path(ctl: Any, num_receivers: int, trainer_why: str | None, policy: str, timeout_s: float,
                version: int, *, policy_key: str = "inplace") -> dict:
    """Trainer rank 0: read every rollout rank's capability, decide, publish; returns the decision
    (``mode``, ``why``, ``leaders``, and ``version``: this sync's version, above every engine's
    ``held`` in place). ``policy_key``: the host's name for ``policy``, in messages."""
    ranks = [json.loads(ctl.get(rollout_mode_key(r), timeout_s, what=f"rollout rank {r} (in-place capability)"))
             for r in range(num_receivers)]
    why = ""
    if policy == "off":
        why = f"{policy_key}='off'"
    elif trainer_why is not None:
        why = f"trainer ranks send full tensors ({trainer_why})"
    else:
        bad = [(r, m["why"]) for r, m in enumerate(ranks) if not m["inplace"]]
        if bad:
            why = f"rollout rank {bad[0][0]}: {bad[0][1]}"
        elif not any(m["leader"] for m in ranks):
            why = "no rollout rank holds a server handle (replica leader)"
    leaders = [[r, int(m["workers"])] for r, m in enumerate(ranks) if m["inplace"] and m["leader"]]
    if not why and sum(w for _, w in leaders) != num_receivers:
        why = (f"the replica leaders drive {sum(w for _, w in leaders)} engine workers, the host lists "
               f"{num_receivers} rollout ranks")
    if not why:  # the engines outlive this session: its versions start above what any of them holds
        version = max([version] + [int(m.get("held", 0)) + 1 for m in ranks if m["leader"]])
    decision = {"mode": "fulltensor" if why else "inplace", "why": why, "leaders": leaders, "version": version}
    if why and policy == "on":
        ctl.set(MODE_KEY, json.dumps({**decision, "mode": "error"}))
        raise ConfigError(f"{policy_key}='on' but the in-place path cannot serve: {why}")
    ctl.set(MODE_KEY, json.dumps(decision))
    if why:
        log.warning("fastsync: full-copy path for this session (rollout ranks receive full tensors and the host "
                    "loads them): %s", why)
    else:
        log.info("fastsync: in-place path: writes land in the live engine weights of %d replica(s)", len(leaders))
    return decision


def read_path(ctl: Any, timeout_s: float, who: str) -> dict:
    got = json.loads(ctl.get(MODE_KEY, timeout_s, what=f"trainer rank 0 (session path), for {who}"))
    if got["mode"] == "error":
        raise ConfigError(f"{who}: trainer rank 0 refused the session: {got['why']}")
    return got
