"""argparse types with bounds: a bad number is a usage error (exit 2, the flag named, no
traceback) before any model is built or process spawned. The checks are those of
``fastsync.layout.limits``, so the CLI and the library refuse the same values."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from fastsync.errors import ConfigError
from fastsync.layout.limits import MAX_TIMEOUT_S, check_count, check_number

__all__ = ["int_in", "float_in", "seconds", "nonempty"]


def int_in(lo: int, hi: int) -> Callable[[str], int]:
    """An integer in ``[lo, hi]`` (``1.5``, ``1e9`` and ``nan`` are refused, not rounded)."""

    def parse(text: str) -> int:
        t = text.strip()
        if not (t.lstrip("+-").isascii() and t.lstrip("+-").isdigit()) or len(t) > 12:
            raise argparse.ArgumentTypeError(f"expected an integer in {lo}..{hi}, got {text!r}")
        try:
            return check_count("value", int(t), lo=lo, hi=hi)
        except ConfigError as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix("value ").removeprefix("= ")) from None

    parse.__name__ = "integer"
    return parse


def float_in(lo: float, hi: float, *, lo_open: bool = True) -> Callable[[str], float]:
    """A finite number in ``(lo, hi]`` (``[lo, hi]`` with ``lo_open=False``); nan/inf refused."""

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        try:
            return check_number("value", v, lo=lo, hi=hi, lo_open=lo_open)
        except ConfigError as e:
            raise argparse.ArgumentTypeError(str(e).removeprefix("value ").removeprefix("= ")) from None

    parse.__name__ = "number"
    return parse


#: A deadline in seconds: positive, finite, at most a day.
seconds = float_in(0.0, MAX_TIMEOUT_S)


def nonempty(text: str) -> str:
    """A non-blank string."""
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


nonempty.__name__ = "string"
