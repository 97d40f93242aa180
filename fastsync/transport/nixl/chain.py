"""One hop of a relay chain over NIXL: what dense relays (``relay.py``) and delta-stream
relays (``delta_relay.py``) share.

An engine rank on a chain receives from at most one upstream engine rank and forwards to its
children (the same rank of the next replicas). Both payloads follow the same rules, kept here once:

* a child announces it is armed for a version (``armed_key``: its agent name), and a parent posts
  to it only then, reconnecting first when the child renewed its endpoint;
* a relay notification counts only from the agent the upstream rank announced on the
  authenticated control plane, with a good MAC over (kind, agent, receiver, numbers), for the open
  version (``nixl_notes``); anything else is refused and counted by the caller's ``refuse``;
* a forward that fails marks its child failed (a dead child does not fail its parent); forwards
  still in flight when a version closes are settled (``nixl_writes.settle``) before the next
  version posts again.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterable
from typing import Any

from fastsync.control import StoreUnreachable
from fastsync.protocol import armed_key, nixl_meta_key
import fastsync.transport.nixl.notes as notes
from fastsync.transport.nixl.teardown import quiesce
from fastsync.transport.nixl.writes import PreparedWrite, reconnect_peer, settle

__all__ = ["ChainHop"]

_READ_TIMEOUT_S = 1.0  # one control-plane read while the engine rank polls


class ChainHop(ABC):
    """Shared state of one engine rank's relay hop. Subclasses set ``agent`` (an attribute or a
    property), ``kind`` (their notification kind) and implement :meth:`_writes` (every prepared
    forward) and :meth:`_announce_key` (where an upstream rank publishes its agent for a child)."""

    kind = ""
    agent: Any

    def __init__(self, control: Any, rank: int, upstream: int | None, timeout_s: float, *, key: bytes,
                 refuse: Callable[[str, str, bytes], None]) -> None:
        self.control, self.rank, self.upstream, self.timeout_s = control, rank, upstream, timeout_s
        self._key, self._refuse = key, refuse
        self._upstream_agent: str | None = None  # what the upstream rank announced (re-read on a mismatch)
        self._upstream_info: dict | None = None
        self._remote: dict[int, str] = {}  # child -> its agent as added here
        self._posted: dict[Hashable, list[Any]] = {}  # (child, unit) -> posted handles
        self._moving: list[tuple[int, Hashable, Any]] = []  # (child, unit, handle) posted, not yet seen done
        self._armed: set[int] = set()
        self.failed: dict[int, str] = {}
        self._unsettled, self._broken = False, set()

    @abstractmethod
    def _writes(self) -> Iterable[PreparedWrite]:
        """Every forward this hop prepared."""

    @abstractmethod
    def _announce_key(self, upstream: int, child: int) -> str:
        """Where ``upstream`` publishes the agent it forwards to ``child`` from."""

    # ---- per version ------------------------------------------------------------------------
    def _open(self, version: int) -> None:
        """Settle what a failed version left in flight, reset the counts, arm for the upstream."""
        if self._unsettled:
            settle(self._writes(), self._reconnect, self._broken)
            self._broken.clear()
            self._unsettled = False
        self._posted, self._moving, self._armed, self.failed = {}, [], set(), {}
        self.control.set(armed_key(self.rank, version), self._my_agent().encode(), timeout_s=self.timeout_s)

    @abstractmethod
    def _my_agent(self) -> str:
        """The name of the agent this rank receives on now."""

    def _note(self, agent: str, raw: bytes, version: int | None, what: str) -> notes.Note | bool:
        """``raw`` as this hop's notification: the Note when it counts, False when it is not of
        this kind at all, True when it was this kind but refused (counted)."""
        try:
            note = notes.decode(raw, self.kind)
        except ValueError:
            self._refuse(f"malformed {what} notification", agent, raw)
            return True
        if note is None:
            return False
        up = self.upstream
        if up is None:
            self._refuse(f"no {what} into this rank", agent, raw)
            return True
        if agent != self._upstream_agent:
            try:
                got = self.control.try_get(self._announce_key(up, self.rank), timeout_s=_READ_TIMEOUT_S)
            except StoreUnreachable:
                got = None
            self._upstream_info = json.loads(got) if got is not None else None
            self._upstream_agent = self._upstream_info["agent"] if self._upstream_info else None
        if agent != self._upstream_agent:
            self._refuse(f"not engine rank {up}'s agent", agent, raw)
        elif not notes.authentic(self._key, note, agent=agent, dst=self.rank):
            self._refuse("bad MAC", agent, raw)
        elif note.version != version:
            self._refuse(f"{what} notification of another version", agent, raw)
        else:
            return note
        return True

    def _child_armed(self, child: int, version: int) -> bool | None:
        """Whether ``child`` is armed for ``version`` (reconnecting to a renewed endpoint first);
        None when the store cannot be reached now (try again at the next poll)."""
        if child in self._armed:
            return True
        try:
            armed = self.control.try_get(armed_key(child, version), timeout_s=_READ_TIMEOUT_S)
        except StoreUnreachable:
            return None
        if armed is None:
            return False
        name = armed.decode(errors="replace")
        if name not in ("1", self._remote.get(child)):  # the child renewed its endpoint: connect afresh
            try:
                self._reconnect(child)
            except Exception as e:
                self.failed[child] = f"cannot reconnect to its new endpoint: {e}"
                return False
        self._armed.add(child)
        return True

    def _post(self, child: int, unit: Hashable, writes: list[tuple[PreparedWrite, bytes]], what: str) -> None:
        """Post ``writes`` (each with its notification) to ``child`` as one unit."""
        posted = []
        for w, msg in writes:
            if w.post(msg) == "ERR":  # e.g. a dead child's agent
                self.failed[child] = f"posting {what} failed"
                self._broken.add(child)
                break
            posted.append(w.handle)
        self._posted[(child, unit)] = posted
        self._moving += [(child, unit, h) for h in posted]

    def forwards_done(self) -> bool:
        """Every forward posted and finished (a failed one counts as finished, noted in ``failed``).
        Checks each forward still in flight (the check is what makes NIXL send its notification)
        and none seen done before: a chain's engine rank calls this every poll, and checking every
        posted forward each time made a 1 MiB-unit chain's polls cost milliseconds of CPU each."""
        moving = []
        for child, unit, h in self._moving:
            if child in self.failed:
                continue
            try:
                state = self.agent.check_xfer_state(h)
            except Exception:
                state = "ERR"
            if state == "ERR":
                self.failed[child] = f"relay of unit {unit} failed"
            elif state != "DONE":
                moving.append((child, unit, h))
        self._moving = [m for m in moving if m[0] not in self.failed]
        return not self._moving

    def quiesce(self, deadline: float) -> None:
        """When the version closes: let posted forwards finish (bounded); any still in flight, or
        any that failed, are settled before the next version forwards again."""
        quiesce(self.agent, [h for hs in self._posted.values() for h in hs], deadline)
        if self.failed or any(w.state() not in ("DONE", "UNKNOWN") for w in self._writes()):
            self._unsettled = True

    def _reconnect(self, child: object) -> None:
        """The child's connection broke, or it renewed its endpoint: forget its agent, add it again
        from its published metadata, and prepare every forward to it afresh."""
        child = int(child)  # type: ignore[arg-type]
        self._remote[child] = reconnect_peer(
            self.agent, self._writes(), child, self._remote.get(child),
            lambda: self.control.get(nixl_meta_key(child), self.timeout_s,
                                     what=f"engine rank {child} (relay target of engine rank {self.rank})"),
            f"engine rank {self.rank}")
