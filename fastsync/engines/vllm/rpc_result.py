"""How a fastsync worker RPC returns: an exception escaping ``collective_rpc`` would kill the
engine, so every worker method runs its body through :func:`call_result`, which turns an exception
into an error reply the engine handle (``handle.py``) re-raises with its type and message."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastsync.host.replies import error_reply

__all__ = ["call_result"]

log = logging.getLogger("fastsync.engines.vllm.extension")


def call_result(fn: Callable[[], Any]) -> Any:
    """Run ``fn``; any exception comes back as a result the host re-raises."""
    try:
        return fn()
    except Exception as e:
        log.warning("fastsync worker call failed: %s: %s", type(e).__name__, e)
        return error_reply(e)
