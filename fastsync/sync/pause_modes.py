"""vLLM's pause modes by name (``vllm.v1.engine.PauseMode``), for ``WeightSync(pause_mode=...)``
and the engine handles that honour them (``fastsync.engines.vllm.pause`` says what each does)."""

from __future__ import annotations

from typing import Any

from fastsync.errors import ConfigError

__all__ = ["PAUSE_MODES", "DEFAULT_PAUSE_MODE", "check_pause_mode"]

#: vLLM's pause modes, in its order
PAUSE_MODES = ("abort", "wait", "keep")
#: requests in flight finish on the old version, none aborted, none straddles a flip: on-policy
DEFAULT_PAUSE_MODE = "wait"


def check_pause_mode(mode: Any, supported: tuple[str, ...], engine: str, key: str = "pause_mode") -> str:
    """``mode`` if ``engine`` can pause that way; ConfigError naming the mode (and the option
    ``key`` it came from, e.g. a host's config key) otherwise."""
    if mode not in PAUSE_MODES:
        raise ConfigError(f"{key} must be one of {list(PAUSE_MODES)} (vLLM's pause modes), got {mode!r}")
    if mode not in supported:
        raise ConfigError(f"pause_mode={mode!r}: {engine} cannot pause that way (it can: {list(supported)})")
    return mode
