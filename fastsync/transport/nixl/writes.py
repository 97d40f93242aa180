"""Prepared NIXL WRITEs that survive a failed version: what each was made from, and how a handle
left in flight is replaced before it is posted again.

A version that fails by its deadline (a cut link, an engine that stopped reading) can leave its
WRITEs in flight: ``quiesce`` waits a few seconds, bounded, and then the sync gives up. NIXL
refuses to post a handle whose request is still in progress (``NIXL_ERR_REPOST_ACTIVE``), so
the first version after the link came back used to fail too. :func:`settle` runs before a
transport posts again after a failure and leaves every handle postable:

* a handle whose request has ended (``DONE``, or never posted) is reused as it is;
* one still in progress (``PROC``) is released, which makes NIXL cancel its UCX requests, and a
  fresh handle is prepared over the same descriptors. Bytes the cancelled request had already
  handed to the network may still land; they carry the failed version's data into memory the next
  version overwrites in full before it can complete (and its notifications are refused as "old
  version"), on the same connection, in order;
* one in error (``ERR``: the connection broke, e.g. ``NIXL_ERR_REMOTE_DISCONNECT`` after a long
  cut) marks its peer for ``reconnect``: the caller forgets the remote agent, loads its metadata
  again, and every handle to that peer is prepared afresh.

The dense path (``transport.py``), delta pages (``delta.py``) and relays (``relay.py``) keep
their handles as :class:`PreparedWrite` and settle them the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from typing import Any

from fastsync.errors import TransportError

__all__ = ["PreparedWrite", "settle", "rebind", "is_disconnect", "mem_of", "reconnect_peer"]


def mem_of(t: Any) -> tuple[str, int]:
    """Where a tensor's bytes are, as NIXL names memory: ``("DRAM", 0)`` or ``("VRAM", device)``."""
    return ("DRAM", 0) if t.device.type == "cpu" else ("VRAM", t.device.index or 0)


def is_disconnect(e: BaseException) -> bool:
    """Whether NIXL raised because the connection to the peer broke (``NIXL_ERR_REMOTE_DISCONNECT``)."""
    return "disconnect" in type(e).__name__.lower() or "REMOTE_DISCONNECT" in str(e)


class PreparedWrite:
    """One prepared WRITE (``initialize_xfer``) to the remote agent named ``remote`` (a peer
    ``peer``: an engine rank, a relay child), remade on demand from the same descriptors."""

    __slots__ = ("agent", "ldesc", "rdesc", "remote", "peer", "handle", "what")

    def __init__(self, agent: Any, ldesc: Any, rdesc: Any, remote: str, peer: Hashable, what: str) -> None:
        self.agent, self.ldesc, self.rdesc, self.remote, self.peer, self.what = agent, ldesc, rdesc, remote, peer, what
        self.handle: Any = None
        self.make()

    def make(self) -> None:
        try:
            self.handle = self.agent.initialize_xfer("WRITE", self.ldesc, self.rdesc, self.remote, b"")
        except Exception as e:
            raise TransportError(f"nixl: cannot prepare writes {self.what}: {e}") from e

    def state(self) -> str:
        """``DONE``, ``PROC``, ``ERR`` (also where NIXL raises that the peer disconnected), or
        ``UNKNOWN`` where it raises anything else (a handle never posted)."""
        try:
            return str(self.agent.check_xfer_state(self.handle))
        except Exception as e:
            return "ERR" if is_disconnect(e) else "UNKNOWN"

    def post(self, msg: bytes) -> str:
        """Post with notification ``msg``; ``ERR`` (never raises) when NIXL refuses."""
        try:
            return str(self.agent.transfer(self.handle, msg))
        except Exception:
            return "ERR"

    def renew(self) -> None:
        """Release this handle (NIXL cancels a request still in progress) and prepare a fresh one."""
        try:
            self.agent.release_xfer_handle(self.handle)
        except Exception:
            pass  # NIXL could not cancel it: leave it to the agent's teardown and post a fresh one
        self.handle = None
        self.make()


def settle(writes: Iterable[PreparedWrite], reconnect: Callable[[Hashable], None],
           broken: Iterable[Hashable] = ()) -> dict[str, int]:
    """Make every write postable again after a failed version (see the module docstring).
    ``broken``: peers a post to failed (their connection is suspect). ``reconnect(peer)`` forgets
    that peer's remote agent, adds it again and prepares every write to it afresh. Returns
    counts: ``renewed`` (handles replaced in place), ``reconnected`` (peers)."""
    writes = list(writes)
    broken = set(broken)
    renewed = 0
    for w in writes:
        st = w.state()
        if st == "ERR":
            broken.add(w.peer)
        elif st != "DONE" and w.peer not in broken:  # in flight, or NIXL cannot say: a fresh handle
            w.renew()
            renewed += 1
    for peer in sorted(broken, key=str):
        reconnect(peer)
    return {"renewed": renewed, "reconnected": len(broken)}


def rebind(writes: Iterable[PreparedWrite], peer: Hashable, remote: str) -> int:
    """After ``peer`` was connected afresh under ``remote``: release every write to it and prepare
    it again against the new connection. Returns how many."""
    n = 0
    for w in writes:
        if w.peer == peer:
            w.remote = remote
            w.renew()
            n += 1
    return n


def reconnect_peer(agent: Any, writes: Iterable[PreparedWrite], peer: Hashable, old_remote: str | None,
                   read_meta: Callable[[], bytes], who: str) -> str:
    """Forget ``peer``'s NIXL agent and add it again from the metadata it published (its connection
    broke, or it renewed its endpoint): every write to it is released first (a handle must not
    outlive its remote agent) and prepared afresh against the new connection. ``read_meta`` reads the
    peer's published metadata (with its own deadline); ``who`` names this side in the error.
    Returns the new remote name."""
    mine = [w for w in writes if w.peer == peer]
    for w in mine:
        try:
            agent.release_xfer_handle(w.handle)
        except Exception:  # noqa: BLE001 - already gone with the broken connection
            pass
    if old_remote is not None:
        try:
            agent.remove_remote_agent(old_remote)
        except Exception:  # noqa: BLE001
            pass
    meta = read_meta()
    try:
        remote = agent.add_remote_agent(meta)
    except Exception as e:
        raise TransportError(f"nixl: {who} cannot reconnect to engine rank {peer}: {e}") from e
    for w in mine:
        w.remote = remote
        w.make()
    return remote
