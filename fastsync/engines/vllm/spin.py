"""How long vLLM's shared-memory queue readers busy-wait: vLLM's own 1 s, or ``FASTSYNC_VLLM_SPIN_S``.

vLLM's engine core and its workers pass every step and every ``collective_rpc`` through
shared-memory queues (``vllm.distributed.device_communicators.shm_broadcast``). A reader keeps
spinning (``sched_yield``) for ``SpinCondition.busy_loop_s``, 1 s, after each message before it parks
on a ZMQ socket and is woken by the writer. On a GPU host that is one core of many. On a CPU host
(vLLM-CPU) it is a whole core of few, taken from the engine's own kernels and from the trainer
ranks beside it: on a 2-core AMD EPYC an idle tp1 worker burnt 1.0 CPU-s in the 2 s after one
``generate`` and 1.0 CPU-s over 20 RPCs 50 ms apart (a staged sync asks its workers this way while
the writes land), where the engine core, the API process and the trainers wanted the core.

``FASTSYNC_VLLM_SPIN_S`` (seconds, e.g. ``0.01``) sets that window in every vLLM process that loads
fastsync's ``vllm.general_plugins`` entry point: the engine core and every worker. Unset, vLLM keeps
its own. A parked reader is woken by the writer's ZMQ notification, vLLM's own path after any idle
second, so a shorter window costs a socket wake-up for a message that comes after it; vLLM re-reads
the queue at least every 5 s should a notification be lost, and a shorter window parks readers more
often, so that bound applies more often too. The value is read where the plugin loads: a bad one is
refused (ConfigError naming the variable) in the process that builds the engine's arguments, before
any engine process starts.
"""

from __future__ import annotations

import functools
import logging
import os

from fastsync.errors import ConfigError

__all__ = ["SPIN_ENV", "reader_spins", "spin_from_env", "tune_reader_spin"]

log = logging.getLogger("fastsync.engines.vllm")

SPIN_ENV = "FASTSYNC_VLLM_SPIN_S"
_MAX_S = 60.0


def spin_from_env() -> float | None:
    """``FASTSYNC_VLLM_SPIN_S`` in seconds; None when unset or empty. ConfigError naming the
    variable for anything but a number of seconds from 0 to 60."""
    raw = os.environ.get(SPIN_ENV, "").strip()
    if not raw:
        return None
    try:
        s = float(raw)
    except ValueError:
        s = -1.0
    if not 0.0 <= s <= _MAX_S:  # (also refuses nan)
        raise ConfigError(f"{SPIN_ENV}={raw!r}: expected seconds from 0 to {_MAX_S:g} (e.g. 0.01), "
                          "how long vLLM's queue readers spin after each message; unset for vLLM's own 1 s")
    return s


def tune_reader_spin() -> float | None:
    """Called by vLLM's ``load_general_plugins()`` in each of its processes (fastsync's
    ``vllm.general_plugins`` entry point ``fastsync_reader_spin``), before the process makes its
    queues: every reader made afterwards spins ``FASTSYNC_VLLM_SPIN_S`` seconds. Returns the
    window set, or None (unset, or a vLLM without ``SpinCondition``: logged, vLLM's own kept)."""
    s = spin_from_env()
    if s is None:
        return None
    try:
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    except ImportError as e:
        log.warning("%s=%s ignored: this vLLM has no shm_broadcast.SpinCondition (%s)", SPIN_ENV, s, e)
        return None
    if not getattr(SpinCondition.__init__, "_fastsync", False):  # wrapped once a process
        made = SpinCondition.__init__

        @functools.wraps(made)
        def __init__(self, is_reader: bool, *args, **kwargs) -> None:  # noqa: ANN001, ANN002, ANN003
            made(self, is_reader, *args, **kwargs)
            if is_reader:
                self.busy_loop_s = SpinCondition._fastsync_spin_s

        __init__._fastsync = True  # type: ignore[attr-defined]
        SpinCondition.__init__ = __init__
    SpinCondition._fastsync_spin_s = s
    return s


def reader_spins() -> list[float]:
    """The window of every shared-memory queue reader alive in this process (the queues vLLM made,
    found by the garbage collector, not a class default), sorted: what the worker extension's
    ``fastsync_reader_spin`` answers, so a user can see the setting took."""
    import gc

    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    # by type, not isinstance: the collector also holds weak proxies, and isinstance on one whose object
    # is gone raises ReferenceError (vLLM's queues keep such proxies)
    return sorted(o.busy_loop_s for o in gc.get_objects() if issubclass(type(o), SpinCondition) and o.is_reader)
