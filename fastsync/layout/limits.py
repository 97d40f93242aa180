"""Upper bounds and shared checks for the numbers fastsync accepts from users.

Every entry point (spec strings, config.json, CLI flags, ``WeightSync``/sender/receiver
arguments) checks its numbers here, so an absurd value is refused before anything is planned,
allocated or spawned, with a ConfigError naming the parameter and the bound. The bounds are far
above any real deployment (the largest published RL jobs use a few thousand GPUs per side and
models of under 200 layers) and low enough that planning at the bound stays a bounded job.
"""

from __future__ import annotations

import math

from fastsync.errors import ConfigError

__all__ = [
    "MAX_WORLD_SIZE", "MAX_LAYERS", "MAX_EXPERTS", "MAX_DIM", "MAX_MODEL_BYTES", "MAX_TIMEOUT_S",
    "check_count", "check_seconds", "check_bytes", "check_number",
]

#: Ranks on one side (trainer world, or all engine ranks over every replica).
MAX_WORLD_SIZE = 16384
#: Decoder layers of a model (config.json ``num_hidden_layers``).
MAX_LAYERS = 4096
#: Routed experts per MoE layer.
MAX_EXPERTS = 16384
#: Any one dimension of a parameter (vocab, hidden, intermediate, heads x head_dim).
MAX_DIM = 1 << 24
#: Bytes of one model as trained (1 PiB: ~500T bf16 parameters).
MAX_MODEL_BYTES = 1 << 50
#: Longest deadline any wait accepts (one day).
MAX_TIMEOUT_S = 86400.0


def check_count(what: str, value: object, *, lo: int = 1, hi: int) -> int:
    """``value`` as an int in ``[lo, hi]``; ConfigError naming ``what`` and the bound otherwise.
    Booleans and floats (``1.5``, ``nan``, even ``2.0``) are refused, not truncated."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{what} must be an integer, got {value!r}")
    if value < lo:
        raise ConfigError(f"{what} must be at least {lo}, got {value}")
    if value > hi:
        raise ConfigError(f"{what} = {value} is over the limit {hi}")
    return value


def check_number(what: str, value: object, *, lo: float, hi: float, lo_open: bool = True) -> float:
    """A finite real in ``(lo, hi]`` (``[lo, hi]`` with ``lo_open=False``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{what} must be a number, got {value!r}")
    v = float(value)
    if not math.isfinite(v):
        raise ConfigError(f"{what} must be a finite number, got {value!r}")
    if v < lo or (lo_open and v == lo):
        raise ConfigError(f"{what} must be {'above' if lo_open else 'at least'} {lo:g}, got {value!r}")
    if v > hi:
        raise ConfigError(f"{what} = {value!r} is over the limit {hi:g}")
    return v


def check_seconds(what: str, value: object) -> float:
    """A deadline: positive, finite, at most :data:`MAX_TIMEOUT_S`."""
    return check_number(what, value, lo=0.0, hi=MAX_TIMEOUT_S)


def check_bytes(what: str, value: object, *, lo: int = 1, hi: int = MAX_MODEL_BYTES) -> int:
    """A byte size such as a staging budget: an int in ``[lo, hi]``."""
    return check_count(what, value, lo=lo, hi=hi)
