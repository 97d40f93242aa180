"""How fastsync starts its own rank processes: the bench's trainer and engine ranks, the delta and
reload benches', the demo's trainers and the expert-parallel ranks of ``fastsync moe-bench``.

``spawn`` starts a fresh interpreter for each rank, and each imports torch again: about 1.5
CPU-seconds on a 2-core EPYC, most of a small bench rank's start. ``forkserver`` (the default where
the platform has it) imports torch once, in a server process started on the first rank's start,
and forks every rank from it. The server is a fresh interpreter too (``multiprocessing`` starts it
with ``exec``), so a rank inherits none of its caller's threads, sockets or NIXL agents, as with
``spawn``; it runs the same target in a fresh ``__main__`` as a spawned rank would.

A forked rank would see the environment of the server's start, which may be older than its
caller's (a job secret set since, a variable a test changed): :meth:`RankContext.Process` passes
the caller's environment at each start and the rank takes it before its target runs.

What a forked rank does not take from its caller: settings a library reads once, when it loads, in
the server (OpenMP's ``OMP_*`` are read when torch loads), come from the environment of the server's
start, which for a command is the command's own.

``FASTSYNC_START_METHOD=spawn`` restores one interpreter per rank (for a platform or a plugin
that does not stand forking from a process that imported torch).
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable
from typing import Any

from fastsync.errors import ConfigError

#: Imported once by the fork server; each rank forked from it has them already.
PRELOAD = ("torch",)
START_ENV = "FASTSYNC_START_METHOD"
METHODS = ("forkserver", "spawn")


def env_method(name: str, choices: tuple[str, ...], what: str = "") -> str | None:
    """The start method environment variable ``name`` names, stripped; None when unset or empty;
    ConfigError naming the variable for anything not in ``choices`` (``what`` says what it sets)."""
    want = os.environ.get(name, "").strip()
    if want and want not in choices:
        raise ConfigError(f"{name}={want!r}: expected one of {', '.join(choices)}{what}")
    return want or None


def start_method() -> str:
    """``$FASTSYNC_START_METHOD`` if set, else ``forkserver`` where the platform has it, else
    ``spawn``; any other value raises ConfigError naming the variable."""
    return env_method(START_ENV, METHODS) or ("forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn")


def _with_env(env: dict[str, str], target: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """A forked rank's entry point: take the caller's environment, then run the target."""
    os.environ.clear()
    os.environ.update(env)
    return target(*args, **kwargs)


class RankContext:
    """A ``multiprocessing`` context for rank processes: ``Process``, ``Queue``, ``Pipe`` and the
    rest as the wrapped context has them; ``Process`` hands a forked rank its caller's
    environment."""

    def __init__(self, method: str | None = None) -> None:
        self.method = method or start_method()
        self._ctx = mp.get_context(self.method)
        if self.method == "forkserver":
            self._ctx.set_forkserver_preload(list(PRELOAD))  # no effect once this process's server runs

    def Process(self, target: Callable[..., Any], args: tuple = (), kwargs: dict | None = None,  # noqa: N802
                **kw: Any) -> Any:
        if self.method == "forkserver":
            args, target = (dict(os.environ), target, *args), _with_env
        return self._ctx.Process(target=target, args=args, kwargs=kwargs or {}, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ctx, name)


def rank_context(method: str | None = None) -> RankContext:
    """The context fastsync starts its rank processes with (see the module's docstring)."""
    return RankContext(method)
