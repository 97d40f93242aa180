"""The verification modes' names, without torch: what ``WeightSync(verify=...)``, the adapters'
options and the handshake accept (``fastsync.executor.verify`` computes the digests)."""

from __future__ import annotations

__all__ = ["VERIFY_MODES", "VerifyMode", "verify_mode"]

VERIFY_MODES = ("off", "sample", "full")


class VerifyMode(str):
    """``"off"``, ``"sample"`` or ``"full"``; false only when ``"off"`` (so ``if verify:`` reads right)."""

    def __bool__(self) -> bool:
        return self != "off"


def verify_mode(value: object, what: str = "verify") -> VerifyMode:
    """The mode ``value`` names: True -> full, False/None -> off, or one of :data:`VERIFY_MODES`;
    ConfigError naming ``what`` otherwise."""
    from fastsync.errors import ConfigError

    if value is None or value is False:
        return VerifyMode("off")
    if value is True:
        return VerifyMode("full")
    if isinstance(value, str) and value in VERIFY_MODES:
        return VerifyMode(value)
    raise ConfigError(f"{what} must be one of {list(VERIFY_MODES)} (or True/False), got {value!r}")
