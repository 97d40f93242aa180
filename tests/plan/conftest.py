"""Every planner test runs with one torch thread (see tests/conftest.py: one_torch_thread)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _one_torch_thread(one_torch_thread: None) -> None:
    return None
