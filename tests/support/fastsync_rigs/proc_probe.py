"""A rank target for tests/test_procs.py: reports what the rank saw when its target began."""

from __future__ import annotations

import os
import sys
from typing import Any


def report(results: Any, names: list[str]) -> None:
    """Put ``{"env": {name: value or None}, "torch_loaded": bool, "pid": int}`` on ``results``."""
    results.put({"env": {n: os.environ.get(n) for n in names}, "torch_loaded": "torch" in sys.modules,
                 "pid": os.getpid()})
