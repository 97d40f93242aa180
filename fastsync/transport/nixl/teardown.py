"""Letting a NIXL agent's posted writes finish, and releasing what it holds.

The dense (``transport.py``), delta (``delta.py``) and relay (``relay.py``) paths each own
transfer handles, a memory registration and remote-agent entries on one agent. Teardown must not
raise (it runs on failure paths, after the error that matters), and a failed sync must let the
writes it already posted finish, bounded, before the receivers roll back; otherwise a late WRITE
could land in a tensor that was just restored.
"""
from __future__ import annotations

import time
from collections.abc import Iterable

_POLL_S = 0.0005


def quiesce(agent: object, handles: Iterable[object], deadline: float) -> None:
    """Wait (until ``deadline``, a ``time.monotonic()`` value) for each posted handle to leave PROC.

    A handle that was never posted, or already failed, raises in ``check_xfer_state``: nothing of
    it is in flight, so the wait moves on.
    """
    for h in handles:
        while time.monotonic() < deadline:
            try:
                if agent.check_xfer_state(h) != "PROC":
                    break
            except Exception:
                break
            time.sleep(_POLL_S)


def release(agent: object, handles: Iterable[object] = (), reg: object | None = None,
            remotes: Iterable[str] = ()) -> None:
    """Release transfer handles, deregister ``reg`` and forget remote agents, ignoring failures."""
    for h in handles:
        try:
            agent.release_xfer_handle(h)
        except Exception:
            pass
    if reg is not None:
        try:
            agent.deregister_memory(reg)
        except Exception:
            pass
    for name in remotes:
        try:
            agent.remove_remote_agent(name)
        except Exception:
            pass
