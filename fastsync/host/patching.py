"""One way to hook into a host framework that has no plugin registry: find the hook point by
name, wrap it once, keep the original, undo it.

:func:`resolve` finds ``module.dotted`` or raises :class:`HookPointError` naming the missing
module or attribute, the host's installed version and the versions the adapter was written
for, so a moved hook point stops the launch instead of silently leaving the host's own path in
place. :func:`wrap` replaces ``owner.name`` with ``make(original)`` once (idempotent: the
wrapper is marked and keeps the original as ``__wrapped__``); :func:`unwrap` puts it back.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
from collections.abc import Callable, Sequence
from typing import Any

from fastsync.errors import ConfigError

__all__ = ["HookPointError", "resolve", "wrap", "unwrap", "is_wrapped", "installed_version"]

MARK = "fastsync_wrapped"


class HookPointError(ConfigError):
    """The installed host framework does not have a name an adapter hooks into."""


def installed_version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def resolve(module: str, dotted: str, *, adapter: str, dist: str, supported: Sequence[str]) -> Any:
    """``module.dotted``, or HookPointError naming what is missing in the installed ``dist``."""
    def fail(what: str, why: str) -> HookPointError:
        return HookPointError(f"{adapter}: {what} {why} in the installed {dist} ({installed_version(dist)}); the "
                              f"adapter hooks into it and will not fall back to {dist}'s own path. Supported "
                              f"{dist} versions: {', '.join(supported)}")

    try:
        obj: Any = importlib.import_module(module)
    except ImportError as e:
        raise fail(f"module {module!r}", f"cannot be imported ({type(e).__name__}: {e})") from e
    path = module
    for part in dotted.split(".") if dotted else ():
        path = f"{path}.{part}"
        if not hasattr(obj, part):
            raise fail(f"attribute {path}", "is missing")
        obj = getattr(obj, part)
    return obj


def is_wrapped(fn: Any) -> bool:
    return bool(getattr(fn, MARK, False))


def wrap(owner: Any, name: str, make: Callable[[Callable], Callable], *, who: str) -> bool:
    """Replace ``owner.name`` with ``make(original)`` unless it is wrapped already; True if this
    call wrapped it. ConfigError naming ``who`` and the attribute when there is none to wrap."""
    original = getattr(owner, name, None)
    if original is None:
        raise ConfigError(f"{who}: {getattr(owner, '__qualname__', getattr(owner, '__name__', owner))}.{name} "
                          "not found to hook into")
    if is_wrapped(original):
        return False
    new = functools.wraps(original)(make(original))
    setattr(new, MARK, True)
    setattr(owner, name, new)
    return True


def unwrap(owner: Any, name: str) -> bool:
    """Put the original of a :func:`wrap` back; True if there was a wrapper."""
    current = getattr(owner, name, None)
    if not is_wrapped(current):
        return False
    setattr(owner, name, current.__wrapped__)
    return True
