"""What a replica reports: the weight version it serves and its state."""

from __future__ import annotations

from dataclasses import dataclass

from fastsync.errors import ConfigError

__all__ = ["STATES", "ReplicaState"]

#: ``serving``: answers requests; ``updating``: a sync is open (fenced); ``reloading``: being
#: filled by a peer reload or a checkpoint; ``down``: does not answer.
STATES = ("serving", "updating", "reloading", "down")


@dataclass(slots=True)
class ReplicaState:
    """One replica as the router sees it."""

    name: str
    version: int
    state: str = "serving"
    inflight: int = 0
    floor: int = 0  # set by VersionRouter.pick: the lowest version allowed when it was picked

    def __post_init__(self) -> None:
        if self.state not in STATES:
            raise ConfigError(f"replica {self.name!r}: unknown state {self.state!r}; known: {STATES}")

    def to_json(self) -> dict:
        return {"name": self.name, "version": self.version, "state": self.state, "inflight": self.inflight}
