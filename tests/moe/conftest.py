"""MoE tests: make this folder's helper modules importable (also by spawned EP processes,
which inherit sys.path), since pytest runs with --import-mode=importlib."""

from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
