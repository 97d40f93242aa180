"""The handshake between trainer ranks and engine ranks: the control-plane keys both sides use,
and the version rule.

Keys (under the control plane's prefix; transports keep their own ``nixl/``, ``torch/``,
``rank0/`` namespaces):

* ``{name}/setup{n}/plan``, ``{name}/setup{n}/connected``: WeightSync's n-th set-up (trainer
  rank 0 publishes the plan, then "ok" once engines connected, or ``err:{Type}:{message}``).
* ``recv/{engine_rank}/info``: plan hash, engine-layout hash and landing tensors of one engine rank.
* ``recv/{engine_rank}/begun/{version}``: the engine rank is armed for ``version``: ``1`` or
  ``verify`` (asks senders for checksums), then ``;endpoint=NAME`` when its transport names the
  endpoint it receives on (NIXL: its agent; a new one after a version that did not complete, so
  senders reconnect before writing). See :func:`begun_value` / :func:`parse_begun`. Or
  ``refused:{why}`` when the engine rank refused to begin ``version`` (e.g. it already holds a
  newer one): the trainer ranks fail at once instead of at their deadline (:func:`refused_value`).
* ``send/{trainer_rank}/crc/{version}``, ``send/{trainer_rank}/done/{version}``: a trainer rank's
  checksums and its "ok" / ``err:...`` for ``version``.
* ``recv/{engine_rank}/flipped/{version}``: the engine rank serves ``version`` ("ok") or rolled
  back (``err:...``).

Version rule: each version number is spent once attempted. A failed sync leaves its control-plane
keys and transport notifications behind, so a retry under the same number could read them as its
own. Every party (WeightSync, each sender, each receiver, an engine worker across re-set-ups)
therefore holds a :class:`Versions` and refuses any version at or below the last it attempted,
before anything is armed or published.
"""

from __future__ import annotations

from fastsync.errors import SyncError

__all__ = [
    "Versions",
    "spend_version",
    "setup_plan_key",
    "setup_connected_key",
    "receiver_info_key",
    "begun_key",
    "flipped_key",
    "sender_crc_key",
    "sender_done_key",
    "delta_choice_key",
    "begun_value",
    "parse_begun",
    "refused_value",
]


def spend_version(who: str, version: int, attempted: int) -> int:
    """Return ``version`` as the new last-attempted number, or raise SyncError naming ``who``."""
    if version <= attempted:
        raise SyncError(f"{who}: version {version} was already attempted (last attempted {attempted}); "
                        "a retry needs a new version number")
    return version


class Versions:
    """The version numbers one party has spent: ``spend(v)`` refuses ``v <= attempted``."""

    __slots__ = ("who", "attempted")

    def __init__(self, who: str, attempted: int = 0) -> None:
        self.who = who
        self.attempted = attempted  # the last version attempted: spent, even if it failed

    def spend(self, version: int) -> None:
        self.attempted = spend_version(self.who, version, self.attempted)


def setup_plan_key(name: str, setup: int) -> str:
    return f"{name}/setup{setup}/plan"


def setup_connected_key(name: str, setup: int) -> str:
    return f"{name}/setup{setup}/connected"


def receiver_info_key(engine_rank: int) -> str:
    return f"recv/{engine_rank}/info"


def begun_key(engine_rank: int, version: int) -> str:
    return f"recv/{engine_rank}/begun/{version}"


def flipped_key(engine_rank: int, version: int) -> str:
    return f"recv/{engine_rank}/flipped/{version}"


def sender_crc_key(trainer_rank: int, version: int) -> str:
    return f"send/{trainer_rank}/crc/{version}"


def sender_done_key(trainer_rank: int, version: int) -> str:
    return f"send/{trainer_rank}/done/{version}"


def delta_choice_key(version: int) -> str:
    """``dense`` or ``delta``: what ``WeightSync(delta=True)`` on trainer rank 0 chose for
    ``version``, set before the engines begin it (every engine rank asks for the same kind)."""
    return f"send/delta/{version}"


def begun_value(verify: bool, endpoint: str = "") -> bytes:
    """What an engine rank publishes under :func:`begun_key`."""
    head = b"verify" if verify else b"1"
    return head + (b";endpoint=" + endpoint.encode() if endpoint else b"")


_REFUSED = b"refused:"


def refused_value(why: str) -> bytes:
    """What an engine rank publishes under :func:`begun_key` when it refuses to begin the version."""
    return _REFUSED + why.encode()


def parse_begun(raw: bytes, who: str, version: int) -> tuple[bool, str]:
    """``(verify, endpoint)`` from a :func:`begun_value` (endpoint "" when none was named);
    SyncError naming ``who`` with its reason when it was a :func:`refused_value`."""
    if raw.startswith(_REFUSED):
        raise SyncError(f"{who} refused to begin version {version}: {raw[len(_REFUSED):].decode(errors='replace')}")
    head, _, rest = raw.partition(b";")
    endpoint = rest[len(b"endpoint="):].decode(errors="replace") if rest.startswith(b"endpoint=") else ""
    return head == b"verify", endpoint
