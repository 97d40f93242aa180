"""How a vLLM-CPU engine core starts its workers: vLLM's ``spawn``, or ``fork`` with
``FASTSYNC_VLLM_WORKER_START=fork``.

vLLM-CPU sets ``VLLM_WORKER_MULTIPROC_METHOD=spawn`` for every engine (``vllm/platforms/cpu.py``),
so each worker of an engine (vLLM-CPU runs even a TP=1 model in a worker process) is a fresh
interpreter that imports vLLM, torch and the model code again before it loads a weight: a TP=2
tiny-model engine started in 28 s and 40 CPU-seconds spawned, 12 s and 15 forked (2-core AMD
EPYC). The engine core that starts them has imported all of that already, and it only schedules:
it runs no model, so it has run no OpenMP parallel region when it makes its workers. Forked from
it, a worker starts with vLLM loaded. That is vLLM's own way on GPUs, where the engine core forks
its workers by default.

``FASTSYNC_VLLM_WORKER_START=fork`` does that in every vLLM engine core that loads fastsync's
``vllm.general_plugins`` entry point (``fastsync_worker_start``). vLLM loads general plugins in the
engine core before it builds its executor (``EngineCore.__init__``), and reads the start method
when the executor makes its workers, so the engine core's own ``VLLM_WORKER_MULTIPROC_METHOD`` is
what counts; the process that builds the engine still spawns the engine core, as vLLM-CPU wants
(that process may have run OpenMP, and a child forked from it would hang in its first parallel
region: GNU OpenMP is not fork-safe).

Only where vLLM does not bind the workers' OpenMP threads (``VLLM_CPU_OMP_THREADS_BIND=nobind``):
otherwise vLLM gives each worker its CPUs through environment variables set at that worker's start
(``OMP_NUM_THREADS``, ``GOMP_CPU_AFFINITY``), which OpenMP reads when it loads, and a forked worker
has it loaded already. There the engine core keeps ``spawn`` and logs why (at INFO: vLLM's own
behaviour, not a fault). Unset, or ``spawn``, changes nothing. Any other value gets a ConfigError
naming the variable, in the process that builds the engine's arguments, before any engine process
starts.
"""

from __future__ import annotations

import logging
import multiprocessing
import os

from fastsync.procs import env_method

__all__ = ["WORKER_START_ENV", "fork_workers", "worker_start_from_env"]

log = logging.getLogger("fastsync.engines.vllm")

WORKER_START_ENV = "FASTSYNC_VLLM_WORKER_START"
_METHODS = ("fork", "spawn")


def worker_start_from_env() -> str | None:
    """``FASTSYNC_VLLM_WORKER_START``: ``fork``, ``spawn`` or None when unset or empty; ConfigError
    naming the variable for anything else."""
    return env_method(WORKER_START_ENV, _METHODS, " (how a vLLM-CPU engine core starts its workers); "
                      "unset for vLLM's own (spawn on CPU)")


def _in_engine_core() -> bool:
    """This process is a vLLM engine core (vLLM names it ``EngineCore`` or ``EngineCore_DP<n>``)."""
    return multiprocessing.parent_process() is not None and \
        multiprocessing.current_process().name.startswith("EngineCore")


def fork_workers() -> str | None:
    """Called by vLLM's ``load_general_plugins()`` in each of its processes (fastsync's
    ``vllm.general_plugins`` entry point ``fastsync_worker_start``). In an engine core, with
    ``FASTSYNC_VLLM_WORKER_START=fork`` and unbound OpenMP threads, sets this process's
    ``VLLM_WORKER_MULTIPROC_METHOD=fork`` and returns ``"fork"``; else changes nothing and returns
    None. Elsewhere it only checks the value, so a bad one is refused before any engine starts."""
    want = worker_start_from_env()
    if want != "fork" or not _in_engine_core():
        return None
    bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    if bind != "nobind":
        log.info("%s=fork ignored: VLLM_CPU_OMP_THREADS_BIND=%s binds each worker's OpenMP threads through "
                 "its start environment, which a forked worker does not read; the workers are spawned",
                 WORKER_START_ENV, bind)
        return None
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"
    return "fork"
