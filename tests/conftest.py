"""Fixtures shared across test folders, and ``tests/support`` (the CPU rigs and stand-ins, not in
the wheel) on ``sys.path`` and ``PYTHONPATH``, so Ray workers and job processes find it too."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

SUPPORT = str(Path(__file__).resolve().parent / "support")
if SUPPORT not in sys.path:
    sys.path.insert(0, SUPPORT)
if SUPPORT not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (SUPPORT, os.environ.get("PYTHONPATH")) if p)


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


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_workers(argvs: list[list[str]], env: dict, timeout_s: float, tail_chars: int = 4000) -> list[str]:
    """Start one process per argv, wait for each with a deadline, kill any left, return the tail
    of each one's combined output."""
    import subprocess

    procs = [subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for argv in argvs]
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout_s)
            outputs.append(out.decode(errors="replace")[-tail_chars:])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    return outputs


@pytest.fixture(scope="session")
def free_port():
    """A function returning a free TCP port on 127.0.0.1."""
    return _free_port


@pytest.fixture(scope="session")
def run_workers():
    """``run_workers(argvs, env, timeout_s)``: spawned rank processes, each waited with a deadline."""
    return _run_workers
