"""vLLM engines whose core and worker run in the test's own process, for tests that start many
short-lived TP=1 engines (not a test module)."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def in_process_vllm() -> Iterator[dict]:
    """For TP=1 ``vllm.LLM`` engines started inside the block: the arguments (and environment, for
    engines a helper such as ``run_demo`` starts) that run each engine's core and worker in this
    process (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and the uni executor, as vLLM's own API tests run
    theirs). The same CPUWorker, model runner and fastsync worker extension, without spawning two
    processes that each import vLLM again: an engine start here drops from 16-22 s to under 3 s.
    Not for a test of what needs the core in its own process (requests stepping while a sync runs,
    pause modes, killed engines). Threads unpinned (``nobind``): vLLM would bind this process's
    own. At the end (after the engines are shut down) vLLM's cache of its environment variables is
    dropped, its process group torn down, and torch's thread count (and ``torch.set_num_threads``,
    which vLLM's worker replaces), ``CPUWorker``'s bases (vLLM adds the worker extension to them) and
    this process's environment
    (vLLM's worker writes to it) are as before. vLLM's kernel-override scan is kept off modules it
    cannot read (``_scan_readable_modules_only``)."""
    from vllm.v1.worker.cpu_worker import CPUWorker

    environ, bases = dict(os.environ), CPUWorker.__bases__
    threads, set_num_threads = torch.get_num_threads(), torch.set_num_threads
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_OMP_THREADS_BIND="nobind")
    try:
        with _scan_readable_modules_only():
            yield {"distributed_executor_backend": "uni"}
    finally:
        from vllm import envs
        from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

        # an engine core in this process freezes vLLM's environment variables (enable_envs_cache):
        # unfrozen, so an engine started later reads VLLM_ENABLE_V1_MULTIPROCESSING=1 again
        envs.disable_envs_cache()
        cleanup_dist_env_and_memory()
        # vLLM's CPUWorker.init_device replaces torch.set_num_threads for its whole process with a
        # warning that does nothing: put back, so later tests in this process can set threads
        torch.set_num_threads = set_num_threads
        # vLLM appends the engine's worker_extension_cls to CPUWorker's bases for the process: a
        # later engine with another extension here would fail vLLM's clash check on them
        CPUWorker.__bases__ = bases
        torch.set_num_threads(threads)
        for k in set(os.environ) - set(environ):
            del os.environ[k]
        os.environ.update(environ)


def _unreadable_modules() -> list[str]:
    """Names of loaded modules holding a value whose ``vars()`` is not a dict: once numba is
    imported, ``llvmlite.binding.ffi.lib`` (its ``__getattr__`` answers ``__dict__`` with a
    function wrapper)."""
    names = []
    for name, module in list(sys.modules.items()):
        for value in list((getattr(module, "__dict__", None) or {}).values()):
            try:
                readable = not hasattr(value, "__dict__") or isinstance(vars(value), dict)
            except Exception:
                readable = False
            if not readable:
                names.append(name)
                break
    return names


@contextlib.contextmanager
def _scan_readable_modules_only() -> Iterator[None]:
    """vLLM 0.32's CPU kernel overrides (``register_kernels``, run at each worker's start) scan
    every module in ``sys.modules`` with ``vars(value).get("kernel")``, which fails on a module
    such as ``llvmlite.binding.ffi`` (above). A worker in its own process never imports numba, so
    never meets it; a worker in this pytest process does once another test module imported
    fastsync's delta encoder. For the scan only, those modules (which hold no vLLM kernel) are
    taken out of ``sys.modules`` and put back at once; vLLM's scan itself runs unchanged."""
    from vllm.triton_utils import dispatcher

    scan = dispatcher._rebind_kernels

    def rebind(overrides):
        hidden = {name: sys.modules.pop(name) for name in _unreadable_modules()}
        try:
            scan(overrides)
        finally:
            sys.modules.update(hidden)

    dispatcher._rebind_kernels = rebind
    try:
        yield
    finally:
        dispatcher._rebind_kernels = scan
