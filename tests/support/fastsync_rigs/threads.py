"""Running several in-process "ranks" at once, each on its own thread, with a deadline.

Tests and rigs that drive every trainer rank of a job from one process (``WeightSync.setup``,
``sync``) need the calls to run concurrently (each waits for the others at its barriers) and to
fail loudly, naming the rank, rather than hang when one does not return.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["run_ranks"]


def run_ranks(fns: Sequence[Callable[[], Any]], timeout_s: float = 120.0) -> list[Any]:
    """Call ``fns[i]()`` on thread i; return the results in order, re-raising the first failure.

    Raises ``TimeoutError`` naming the ranks still running after ``timeout_s`` (threads are
    daemons, so a hung rank does not keep the process alive).
    """
    out: list[Any] = [None] * len(fns)

    def go(i: int) -> None:
        try:
            out[i] = fns[i]()
        except BaseException as e:  # handed to the caller below
            out[i] = e

    threads = [threading.Thread(target=go, args=(i,), daemon=True, name=f"rank{i}") for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    hung = [i for i, t in enumerate(threads) if t.is_alive()]
    if hung:
        raise TimeoutError(f"rank(s) {hung} did not return within {timeout_s:g} s")
    for r in out:
        if isinstance(r, BaseException):
            raise r
    return out
