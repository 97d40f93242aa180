"""Planner tests run small torch ops by the thousand: one intra-op thread is 10-50x faster on
this shared 2-core machine than two contending ones. Restored after each test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
