"""Transports: how planned bytes move (``nixl``, ``torch``, ``rank0``). See ``base.py``.

Optional dependencies are probed here without importing the heavy modules' users; asking for a
transport that cannot run says what to install.
"""

from __future__ import annotations

import importlib.util

__all__ = ["availability", "TRANSPORTS"]

TRANSPORTS = ("nixl", "torch", "rank0")



def availability(name: str) -> tuple[bool, str]:
    """``(available, why)`` for a built-in transport name."""
    if name == "nixl":
        # find_spec only: importing nixl._api pulls in torch and the UCX plugins (seconds). A broken
        # install is reported with its ImportError when the transport is constructed.
        if importlib.util.find_spec("nixl") is None:
            return False, "pip install nixl-cu12==1.5.1 && pip install --no-deps nixl==1.5.1"
        return True, ""
    if name in ("torch", "rank0"):
        if importlib.util.find_spec("torch.distributed") is None:
            return False, "torch was built without torch.distributed"
        return True, ""
    return False, f"unknown built-in transport {name!r}"
