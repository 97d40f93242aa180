"""Rolling updates: replicas take a new version in waves while the others keep serving.

``stop-the-world`` (the default, what on-policy rollouts need) updates every replica at once,
with the router taking them all out of rotation; ``rolling`` updates ``ceil(fraction * n)``
replicas per wave (at least one, and never all while more than one exists); each wave is first
drained (no new requests, in-flight ones finish on their version), so the rest keep
answering requests on the previous version, which the router serves only within its staleness.

Each replica is a callable ``update(name, version)`` (e.g. ``VllmEngine.update`` or an HTTP
call to a ``vllm serve`` replica's ``collective_rpc``); the router learns each state change.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

from fastsync.errors import ConfigError, SyncError
from fastsync.route.router import VersionRouter

__all__ = ["RollingUpdate", "MODES"]

MODES = ("stop-the-world", "rolling")


class RollingUpdate:
    """``run(version)`` updates every replica in ``names`` by ``update(name, version)``."""

    def __init__(self, router: VersionRouter, names: list[str], update: Callable[[str, int], object], *,
                 mode: str = "stop-the-world", fraction: float = 0.5, drain_timeout_s: float = 60.0) -> None:
        if mode not in MODES:
            raise ConfigError(f"RollingUpdate mode must be one of {MODES}, got {mode!r}")
        if not 0 < fraction <= 1:
            raise ConfigError(f"RollingUpdate fraction must be in (0, 1], got {fraction}")
        if not names:
            raise ConfigError("RollingUpdate needs at least one replica name")
        self.router, self.names, self.update, self.mode, self.fraction = router, list(names), update, mode, fraction
        self.drain_timeout_s = drain_timeout_s

    def waves(self) -> list[list[str]]:
        n = len(self.names)
        if self.mode == "stop-the-world":
            return [list(self.names)]
        size = max(1, math.ceil(self.fraction * n))
        if n > 1:
            size = min(size, n - 1)  # someone always keeps serving
        return [self.names[i: i + size] for i in range(0, n, size)]

    def run(self, version: int) -> list[list[str]]:
        """Update every replica, wave by wave; a failed replica keeps its version and is reported
        (SyncError naming it) after the other waves ran."""
        failed: dict[str, str] = {}
        waves = self.waves()
        for wave in waves:
            for name in wave:
                self.router.set_state(name, state="updating")
            errors: dict[str, BaseException] = {}
            # drain: requests already routed to the wave finish on the version they started with
            deadline = time.monotonic() + self.drain_timeout_s
            while any(s["inflight"] for s in self.router.states() if s["name"] in wave):
                if time.monotonic() > deadline:
                    raise SyncError(f"rolling update to version {version}: replicas {wave} still have requests in "
                                    f"flight after {self.drain_timeout_s:.0f} s")
                time.sleep(0.01)

            def go(name: str) -> None:
                try:
                    self.update(name, version)
                except BaseException as e:
                    errors[name] = e

            threads = [threading.Thread(target=go, args=(n,), daemon=True) for n in wave]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            for name in wave:
                if name in errors:
                    failed[name] = f"{type(errors[name]).__name__}: {errors[name]}"
                    self.router.set_state(name, state="serving")  # it rolled back: still its old version
                else:
                    self.router.set_state(name, version=version, state="serving")
        if failed:
            raise SyncError(f"rolling update to version {version}: replica(s) kept their version: {failed}")
        return waves
