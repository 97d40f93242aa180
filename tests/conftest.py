"""Fixtures shared across test folders."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """Tests that run small torch ops by the thousand: one intra-op thread is 10-50x faster on a
    shared 2-core machine than two contending ones. Restored after the test."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
