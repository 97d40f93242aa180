"""The control-store keys and error texts of fastsync's backend of vLLM's weight-transfer API.

vLLM's calls carry small JSON and return nothing a trainer can read (the HTTP client keeps only a
status code), so the workers and trainer rank 0 meet under these keys, below the set-up's prefix:
descriptions, the plan, connect results, per-version results and, with staged receive, the version
to open and when its writes landed. Errors travel as ``err:{Type}:{message}``.
"""

from __future__ import annotations

from fastsync.errors import error_text, raise_error_text  # the one codec, re-exported for the wt modules

__all__ = ["describe_key", "connect_key", "connected_key", "version_key", "open_key", "staged_key", "error_text",
           "raise_error_text"]


def describe_key(engine_rank: int) -> str:
    """An engine rank's description (JSON), or ``err:{Type}:{message}``."""
    return f"wt/engine/{engine_rank}/describe"


def connect_key() -> str:
    """Trainer rank 0's plan and connect options (JSON), or ``err:{Type}:{message}``."""
    return "wt/connect"


def connected_key(engine_rank: int) -> str:
    """An engine rank's connect result (JSON), or ``err:{Type}:{message}``."""
    return f"wt/engine/{engine_rank}/connected"


def version_key(engine_rank: int, version: int) -> str:
    """An engine rank's result of ``update_weights`` for ``version`` (JSON), or ``err:...``."""
    return f"wt/engine/{engine_rank}/v{version}"


def open_key() -> str:
    """Staged receive: the version (and its deadline) trainer rank 0 opens with the next
    ``start_weight_update`` (JSON ``{"version": V, "timeout_s": T}``); vLLM's call carries none."""
    return "wt/open"


def staged_key(engine_rank: int, version: int) -> str:
    """Staged receive: an engine rank's writes of ``version`` all landed (JSON with
    ``received_s``), or ``err:...`` when the receive failed; published while the engine generates."""
    return f"wt/engine/{engine_rank}/staged/{version}"
