"""The sync options every entry point takes, checked in one place: ``WeightSync``'s arguments,
verl's ``engine_kwargs.fastsync.*`` and OpenRLHF's ``--fastsync.*`` (``delta``, ``fanout``,
``staged``, ``transport``, ``timeout_s``). Each refusal names the option as that entry point's users
write it (a :class:`Spelling`), before anything starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastsync.errors import ConfigError
from fastsync.layout.limits import check_seconds

__all__ = ["FANOUTS", "Spelling", "PYTHON", "check_sync_options"]

#: ``fanout``: ``off`` (replicas planned apart), ``direct`` (every replica from the trainer ranks),
#: ``chain`` (relays between identical replicas' engine ranks), ``auto`` (the cost model picks)
FANOUTS = ("off", "auto", "chain", "direct")
_RELAYING = ("auto", "chain")


@dataclass(frozen=True)
class Spelling:
    """How users of an entry point write an option: ``prefix`` before its name, the words for true
    and false, and whether they are command-line flags (``--fastsync.delta``, ``--fastsync.transport
    torch``) or assignments (``delta=True``, ``engine_kwargs.fastsync.transport='torch'``)."""

    prefix: str = ""
    true: str = "True"
    false: str = "False"
    cli: bool = False

    def key(self, name: str) -> str:
        return f"{self.prefix}{name}"

    def on(self, name: str) -> str:
        """The boolean option ``name`` turned on."""
        return self.key(name) if self.cli else f"{self.key(name)}={self.true}"

    def value(self, name: str, value: Any) -> str:
        return f"{self.key(name)} {value}" if self.cli else f"{self.key(name)}={value!r}"


#: ``WeightSync``'s keyword arguments
PYTHON = Spelling()


def check_sync_options(spell: Spelling = PYTHON, *, transport: str, timeout_s: Any, delta: Any = False,
                       fanout: Any = "off", staged: Any = False) -> None:
    """ConfigError naming the option (as ``spell`` writes it) for a value out of range, or for two
    that cannot go together: a delta and relays write over NIXL only; a staged receive lands off
    the live weights, which a delta patches."""
    check_seconds(spell.key("timeout_s"), timeout_s)  # finite, positive, at most a day: every wait has a deadline
    for name, v in (("delta", delta), ("staged", staged)):
        if not isinstance(v, bool):
            raise ConfigError(f"{spell.key(name)} must be {spell.true} or {spell.false}, got {v!r}")
    if fanout not in FANOUTS:
        raise ConfigError(f"{spell.key('fanout')} must be one of {', '.join(FANOUTS)}, got {fanout!r}")
    if delta and transport != "nixl":
        raise ConfigError(f"{spell.on('delta')} writes over NIXL; {spell.value('transport', transport)} "
                          "does not support it")
    if fanout in _RELAYING and transport != "nixl":
        raise ConfigError(f"{spell.value('fanout', fanout)} may relay between engine ranks, which only transport "
                          f"'nixl' does; {spell.value('transport', transport)}: use {spell.key('fanout')} "
                          "'direct' or 'off'")
    if staged and delta:
        raise ConfigError(f"{spell.on('staged')} with {spell.on('delta')}: a delta patches the live weights, a "
                          "staged receive lands off them; choose one")
