"""Reading an HF ``config.json``: one reader for every command (plan, bench, moe-bench,
delta-bench, the inventories), so a bad file gets the same named error everywhere."""

from __future__ import annotations

import json
import os

from fastsync.errors import ConfigError

__all__ = ["MAX_CONFIG_BYTES", "read_config_json"]

#: A config.json is a few kB; anything this large is not one.
MAX_CONFIG_BYTES = 16 << 20


def _refuse_constant(name: str) -> object:
    raise ValueError(f"{name} is not a valid config.json number")


def read_config_json(path: str) -> dict:
    """The JSON object in the ``config.json`` at ``path``; ConfigError naming the file when it is
    unreadable, too large, not JSON, holds NaN/Infinity, or is not a JSON object. Every command
    that reads a config.json goes through here."""
    try:
        if os.path.getsize(path) > MAX_CONFIG_BYTES:
            raise ConfigError(f"{path!r} is {os.path.getsize(path)} bytes, over the limit {MAX_CONFIG_BYTES} for a config.json")
        with open(path, encoding="utf-8") as f:
            config = json.load(f, parse_constant=_refuse_constant)
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as e:
        # JSONDecodeError is a ValueError; a non-UTF-8 file raises UnicodeDecodeError
        raise ConfigError(f"cannot read {path!r}: {type(e).__name__}: {e}") from e
    if not isinstance(config, dict):
        raise ConfigError(f"{path!r} is not a JSON object (a config.json holds one), it holds a {type(config).__name__}")
    return config
