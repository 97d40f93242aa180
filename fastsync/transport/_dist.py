"""The torch.distributed world shared by the ``torch`` and ``rank0`` transports.

Trainer rank ``t`` is global rank ``t``, engine rank ``d`` is ``T + d``. The group is created
on the control plane's store (under its own prefix) unless the process already has a default
group of the right size, and waits for work with a deadline instead of blocking.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from fastsync.control import ControlPlane
from fastsync.errors import ConfigError, SyncError, TransportError

__all__ = ["ensure_world", "wait_work", "subgroup", "WorkWaiter"]

_groups: dict[tuple[int, ...], Any] = {}


def ensure_world(control: ControlPlane, global_rank: int, world_size: int, timeout_s: float, backend: str = "gloo") -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_world_size() != world_size or dist.get_rank() != global_rank:
            raise ConfigError(
                f"a torch.distributed group already exists (rank {dist.get_rank()} of {dist.get_world_size()}); "
                f"the sync needs rank {global_rank} of {world_size}"
            )
        return
    store = getattr(control, "store", None)
    if store is None:
        raise ConfigError("the torch/rank0 transports need a TCPStoreControl (or an initialised process group)")
    try:
        dist.init_process_group(backend, store=dist.PrefixStore("fastsync-pg/", store), rank=global_rank,
                                world_size=world_size, timeout=timedelta(seconds=timeout_s))
    except Exception as e:
        raise TransportError(f"cannot join the {backend} group as rank {global_rank} of {world_size}: {e}") from e


def subgroup(ranks: list[int]) -> Any:
    """A process group over ``ranks`` (every process of the world must ask for it, same order)."""
    import torch.distributed as dist

    key = tuple(ranks)
    if key not in _groups:
        _groups[key] = dist.new_group(list(ranks))
    return _groups[key]


def wait_work(work: Any, deadline: float, what: str) -> None:
    """Wait for one async work object until ``deadline``; SyncError (timeout) or TransportError
    naming ``what``. Gloo's point-to-point works never report ``is_completed()``, so this blocks
    in ``wait(timeout)`` (which releases the GIL) rather than polling."""
    left = deadline - time.monotonic()
    if left <= 0 and not work.is_completed():
        raise SyncError(f"{what} not complete by the deadline")
    try:
        work.wait(timeout=timedelta(seconds=max(left, 0.001)))
    except Exception as e:
        if time.monotonic() >= deadline - 0.01:
            raise SyncError(f"{what} not complete by the deadline ({e})") from e
        raise TransportError(f"{what} failed: {e}") from e


class WorkWaiter:
    """Waits for a list of works on a helper thread, so a receiver can poll without blocking.

    ``done()`` is True once all completed; ``error`` holds the first failure (the rest are left).
    ``remaining[key]`` counts the works of each key not yet completed.
    """

    def __init__(self, works: list[tuple[int, Any]], deadline: float, what: Callable[[int], str]) -> None:
        self.remaining: dict[int, int] = {}
        for key, _ in works:
            self.remaining[key] = self.remaining.get(key, 0) + 1
        self.error: BaseException | None = None
        self._works = works
        self._deadline = deadline
        self._what = what
        self._thread = threading.Thread(target=self._run, name="fastsync-recv-wait", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for key, w in self._works:
            try:
                wait_work(w, self._deadline, self._what(key))
            except BaseException as e:
                self.error = e
                return
            self.remaining[key] -= 1

    def done(self) -> bool:
        if self._thread.is_alive():
            return False
        if self.error is not None:
            raise self.error
        return True

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)
