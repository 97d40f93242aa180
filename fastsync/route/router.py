"""Version-aware routing: each request goes only to a replica serving a version within the
allowed staleness of the newest version, and never to one that is updating or reloading.

:class:`VersionRouter` is a plain component: a host adapter (verl's or OpenRLHF's own load
balancer, or :mod:`fastsync.route.http`) calls :meth:`set_state` when a replica reports, and
:meth:`pick` (or :meth:`eligible`, to apply its own balancing among them) per request.
``max_staleness=0`` is on-policy: only replicas on the newest version answer.

A replica's reported version is what the router routes by; the answer's own stamp (the weight
versions that generated it, e.g. vLLM's ``weight_versions`` spans) is what it was made with: a
replica can flip while a request runs (pause mode ``keep``) or flip before it reports. After the
answer, :meth:`judge` applies the same rule to the stamp: the answer is stale when any of its
tokens came from a version below the floor the request was routed under, and a stamp newer than
the replica's reported version raises it (the replica has flipped).

Example::

    router = VersionRouter(max_staleness=1)
    router.set_state("r0", version=3); router.set_state("r1", version=2)
    name = router.pick()            # least in-flight among eligible replicas
    router.done(name)               # when the answer came back
"""

from __future__ import annotations

import threading

from fastsync.errors import ConfigError, FastSyncError
from fastsync.route.state import ReplicaState

__all__ = ["VersionRouter", "NoReplicaError"]


class NoReplicaError(FastSyncError):
    """No replica serves an allowed version (the HTTP front answers 503 with this message)."""


class VersionRouter:
    """Thread-safe table of replica states and the routing rule (see the module docstring)."""

    def __init__(self, max_staleness: int = 0) -> None:
        if max_staleness < 0:
            raise ConfigError(f"max_staleness must be >= 0, got {max_staleness}")
        self.max_staleness = max_staleness
        self._lock = threading.Lock()
        self._replicas: dict[str, ReplicaState] = {}
        self.routed: dict[str, int] = {}
        self.stale_answers: dict[str, int] = {}  # per replica: answers whose stamp fell below the floor

    def set_state(self, name: str, *, version: int | None = None, state: str | None = None) -> None:
        with self._lock:
            r = self._replicas.get(name)
            if r is None:
                if version is None:
                    raise ConfigError(f"replica {name!r}: first report needs a version")
                self._replicas[name] = ReplicaState(name, int(version), state or "serving")
                return
            if version is not None:
                r.version = int(version)
            if state is not None:
                r.state = ReplicaState(name, r.version, state).state  # validated

    def remove(self, name: str) -> None:
        with self._lock:
            self._replicas.pop(name, None)

    def newest(self) -> int | None:
        with self._lock:
            vs = [r.version for r in self._replicas.values() if r.state != "down"]
        return max(vs) if vs else None

    def allowed(self, version: int) -> bool:
        newest = self.newest()
        return newest is not None and version >= newest - self.max_staleness

    def eligible(self, min_version: int | None = None) -> list[ReplicaState]:
        """Replicas that may answer now: serving, within staleness of the newest version (and at
        least ``min_version`` when the caller asks for one)."""
        with self._lock:
            live = [r for r in self._replicas.values() if r.state != "down"]
            if not live:
                return []
            floor = max(r.version for r in live) - self.max_staleness
            if min_version is not None:
                floor = max(floor, min_version)
            return [ReplicaState(r.name, r.version, r.state, r.inflight) for r in live
                    if r.state == "serving" and r.version >= floor]

    def pick(self, min_version: int | None = None) -> ReplicaState:
        """The eligible replica with the fewest requests in flight (counted until :meth:`done`);
        NoReplicaError naming the versions on offer when there is none."""
        with self._lock:
            live = [r for r in self._replicas.values() if r.state != "down"]
            floor = (max(r.version for r in live) - self.max_staleness) if live else 0
            if min_version is not None:
                floor = max(floor, min_version)
            ok = [r for r in live if r.state == "serving" and r.version >= floor]
            if not ok:
                offer = {r.name: f"v{r.version} {r.state}" for r in self._replicas.values()}
                raise NoReplicaError(f"no replica serves version >= {floor} (max staleness {self.max_staleness}); "
                                     f"replicas: {offer or 'none'}")
            best = min(ok, key=lambda r: (r.inflight, self.routed.get(r.name, 0)))
            best.inflight += 1
            self.routed[best.name] = self.routed.get(best.name, 0) + 1
            return ReplicaState(best.name, best.version, best.state, best.inflight, floor)

    def judge(self, name: str, versions: list[int], floor: int) -> bool:
        """The staleness rule on an answer's stamp: True when every version that generated it is
        at least ``floor`` (the floor :meth:`pick` routed it under). A version newer than the
        replica's reported one becomes its version. ``versions`` empty (no stamp): True."""
        if not versions:
            return True
        with self._lock:
            r = self._replicas.get(name)
            if r is not None and max(versions) > r.version:
                r.version = max(versions)
            ok = min(versions) >= floor
            if not ok:
                self.stale_answers[name] = self.stale_answers.get(name, 0) + 1
            return ok

    def done(self, name: str) -> None:
        with self._lock:
            r = self._replicas.get(name)
            if r is not None and r.inflight > 0:
                r.inflight -= 1

    def states(self) -> list[dict]:
        with self._lock:
            return [r.to_json() for r in sorted(self._replicas.values(), key=lambda r: r.name)]
