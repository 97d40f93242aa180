"""Sessions and versions for a host that rebuilds its sync group before every sync, handed out
by one master trainer rank (verl's ``CheckpointEngineManager.update_weights``: ``prepare`` on
every rank, ``build_topology`` in the manager's process, ``init_process_group`` on every rank).

The host may change the members between two syncs (verl's ``remove_replicas`` /
``add_replicas``), and a removed member keeps its old state. So no rank may count sessions or
versions on its own: a re-added rank would resume a stale count, a brand-new one would start at
zero and wait in a session nobody else is in.

Every rank reports a unique id and the session it last joined (:func:`session_meta`); the master also spends the next
version (:meth:`MasterState.spend`) and reports the session it leads and its members.
:func:`assign_session` (a pure function of that metadata, trainers first) keeps the session only if the
members, in rank order, are exactly the session's and every one of them joined it; otherwise it
names a fresh session (unique: the master's id and the version just spent). A rank whose session
changed drops its plan, buffers and registrations, so removed, re-added and new members get a
fresh plan and, with the sync that follows, the current weights.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from fastsync.errors import ConfigError

__all__ = ["CONTROL_KEY", "ID_KEY", "JOINED_KEY", "MASTER_KEY", "MasterState", "Assignment", "assign_session",
           "new_member_id", "session_meta"]

CONTROL_KEY = "fastsync_control"  # [host, port, job secret] of the control plane (master only)
ID_KEY = "fastsync_id"  # the reporting rank's unique id (every rank)
JOINED_KEY = "fastsync_joined"  # the session the rank is set up in, or None (every rank)
MASTER_KEY = "fastsync_master"  # {"session", "members", "version", "uid"} (master only)


def new_member_id() -> str:
    return uuid.uuid4().hex


@dataclass(slots=True)
class MasterState:
    """What the master trainer rank keeps across syncs: the session it leads, that session's
    members (rank ids in rank order: trainers, then rollouts) and the last version it spent."""

    uid: str = field(default_factory=new_member_id)
    session: str | None = None
    members: tuple[str, ...] = ()
    version: int = 0

    def spend(self) -> dict[str, Any]:
        """Spend the next version (spent even if the sync then fails) and describe the state."""
        self.version += 1
        return {"uid": self.uid, "session": self.session, "members": list(self.members), "version": self.version}

    def joined(self, session: str, members: list[str]) -> None:
        self.session, self.members = session, tuple(members)


def session_meta(member_id: str, joined: str | None, master: MasterState | None = None,
                 control: list | None = None) -> dict[str, Any]:
    """What one rank reports before a sync (verl: ``prepare``): its id and the session it joined;
    the master also the control plane's address (``control_address``, carried by the host's own
    channel, never fastsync's) and its state, spending the next version."""
    meta: dict[str, Any] = {ID_KEY: member_id, JOINED_KEY: joined}
    if master is not None:
        meta[CONTROL_KEY] = control
        meta[MASTER_KEY] = master.spend()
    return meta


@dataclass(frozen=True, slots=True)
class Assignment:
    session: str
    version: int
    control: tuple  # [host, port, job secret] as the master published it
    members: tuple[str, ...]
    fresh: bool  # a new session: every rank re-plans


def assign_session(num_trainers: int, num_rollouts: int, metadata: list[dict]) -> Assignment:
    """The session and version for this sync, from every rank's ``prepare`` metadata (trainers
    first, then rollouts, as verl's manager concatenates them)."""
    if len(metadata) != num_trainers + num_rollouts:
        raise ConfigError(f"fastsync: {len(metadata)} metadata entries for {num_trainers} trainer "
                          f"and {num_rollouts} rollout ranks")
    masters = [i for i, m in enumerate(metadata[:num_trainers]) if m and MASTER_KEY in m]
    if len(masters) != 1:
        raise ConfigError("fastsync: expected exactly one master trainer rank (verl: is_master=True, given to "
                          f"torch rank 0) publishing the control plane, got trainer ranks {masters}")
    missing = [i for i, m in enumerate(metadata) if not m or ID_KEY not in m]
    if missing:
        raise ConfigError(f"fastsync: ranks {missing} (trainers first, then rollouts) sent no fastsync metadata; "
                          "every rank must run the fastsync backend")
    master = metadata[masters[0]]
    members = tuple(m[ID_KEY] for m in metadata)
    if len(set(members)) != len(members):
        raise ConfigError("fastsync: one checkpoint engine appears twice among the ranks of this sync")
    state = master[MASTER_KEY]
    version = int(state["version"])
    keep = (state["session"] is not None and tuple(state["members"]) == members
            and all(m.get(JOINED_KEY) == state["session"] for m in metadata))
    session = state["session"] if keep else f"{state['uid']}.v{version}"
    return Assignment(session, version, tuple(master[CONTROL_KEY]), members, not keep)
