"""Weight version numbers: each is spent once attempted.

A failed sync leaves its control-plane keys and NIXL notifications behind, so a retry under the
same number could read them as its own. Senders, receivers and WeightSync therefore refuse any
version at or below the last one they attempted, before anything is armed or published.
"""

from __future__ import annotations

from fastsync.errors import SyncError

__all__ = ["spend_version"]


def spend_version(who: str, version: int, attempted: int) -> int:
    """Return ``version`` as the new last-attempted number, or raise SyncError naming ``who``."""
    if version <= attempted:
        raise SyncError(f"{who}: version {version} was already attempted (last attempted {attempted}); "
                        "a retry needs a new version number")
    return version
