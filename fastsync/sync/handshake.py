"""The handshake between trainer ranks and engine ranks: the control-plane keys both sides use,
and the version rule.

Keys (built in :mod:`fastsync.protocol`, which lists every key in the order they are used):

* ``{name}/setup{n}/plan``, ``{name}/setup{n}/connected``: WeightSync's n-th set-up (trainer
  rank 0 publishes the plan, then "ok" once engines connected, or ``err:{Type}:{message}``).
* ``recv/{engine_rank}/info``: plan hash, engine-layout hash and landing tensors of one engine rank.
* ``recv/{engine_rank}/begun/{version}``: the engine rank is armed for ``version``: ``1`` or
  ``verify`` / ``verify-sample`` (asks senders for digests, ``fastsync.executor.verify``), then ``;endpoint=NAME`` when its transport names the
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
from fastsync.executor.verify_mode import VERIFY_MODES, VerifyMode, verify_mode

__all__ = [
    "Versions",
    "spend_version",
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


def begun_value(verify: bool | str, endpoint: str = "") -> bytes:
    """What an engine rank publishes under :func:`begun_key`: the digests it asks the senders for
    (``verify``: ``"full"`` or True, ``"sample"``, ``"off"`` or False), then its endpoint."""
    mode = verify_mode(verify)
    head = b"1" if mode == "off" else (b"verify" if mode == "full" else b"verify-" + mode.encode())
    return head + (b";endpoint=" + endpoint.encode() if endpoint else b"")


_REFUSED = b"refused:"


def refused_value(why: str) -> bytes:
    """What an engine rank publishes under :func:`begun_key` when it refuses to begin the version."""
    return _REFUSED + why.encode()


def parse_begun(raw: bytes, who: str, version: int) -> tuple[VerifyMode, str]:
    """``(verify mode, endpoint)`` from a :func:`begun_value` (endpoint "" when none was named);
    SyncError naming ``who`` with its reason when it was a :func:`refused_value` or asks for a
    mode this side does not know."""
    if raw.startswith(_REFUSED):
        raise SyncError(f"{who} refused to begin version {version}: {raw[len(_REFUSED):].decode(errors='replace')}")
    head, _, rest = raw.partition(b";")
    endpoint = rest[len(b"endpoint="):].decode(errors="replace") if rest.startswith(b"endpoint=") else ""
    if head == b"1":
        return VerifyMode("off"), endpoint
    if head == b"verify":
        return VerifyMode("full"), endpoint
    mode = head[len(b"verify-"):].decode(errors="replace") if head.startswith(b"verify-") else ""
    if mode not in VERIFY_MODES:
        raise SyncError(f"{who} began version {version} asking for verification {head[:40]!r}, which this trainer "
                        f"does not know (known: {list(VERIFY_MODES)})")
    return VerifyMode(mode), endpoint
