"""Built-in plugin: transports. Registered through the `fastsync` entry-point group like any plugin."""

from __future__ import annotations

from fastsync.hookspecs import hookimpl  # noqa: F401
