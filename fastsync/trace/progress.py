"""Progress on stderr for commands that can take more than a couple of seconds.

Shown only when stderr is a terminal and the command is not printing JSON (``--json``), so logs,
pipes and CI see nothing; drawn with tqdm when it is installed (a dependency of vLLM and
huggingface_hub, pinned in requirements/lock.txt), else not at all.

Example::

    with Steps(["layouts", "plan", "simulate"], enabled=auto(json=args.json)) as steps:
        steps.next("building layouts")   # before each step
        ...
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Sequence
from typing import Any, TextIO

__all__ = ["auto", "Steps"]


def auto(*, json: bool = False, stream: TextIO | None = None, force: bool | None = None) -> bool:
    """Whether to draw progress: ``force`` if given, else stderr is a TTY and not ``--json``."""
    if force is not None:
        return force
    s = stream if stream is not None else sys.stderr
    return not json and bool(getattr(s, "isatty", lambda: False)())


def _tqdm(**kw: Any) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:  # progress is a nicety: without tqdm, nothing is drawn
        return None
    return tqdm(**kw)


class Steps:
    """A bar over named steps; ``next(text)`` starts the next one. The elapsed time ticks every
    ``tick_s`` while a long step (planning Kimi-K2: ~10 s) runs, so the terminal never looks hung."""

    def __init__(self, steps: Sequence[str] | int, *, enabled: bool, desc: str = "", stream: TextIO | None = None,
                 tick_s: float = 0.5) -> None:
        total = steps if isinstance(steps, int) else len(steps)
        self._bar = _tqdm(total=total, desc=desc, file=stream or sys.stderr, leave=False, dynamic_ncols=True,
                          bar_format="{desc} [{n_fmt}/{total_fmt}] {elapsed}") if enabled else None
        self._started = False
        self.desc = desc
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        if self._bar is not None:
            self._ticker = threading.Thread(target=self._tick, args=(tick_s,), name="fastsync-progress", daemon=True)
            self._ticker.start()

    def _tick(self, tick_s: float) -> None:
        while not self._stop.wait(tick_s):
            bar = self._bar
            if bar is not None:
                bar.refresh()

    def next(self, text: str) -> None:
        if self._bar is None:
            return
        if self._started:
            self._bar.update(1)
        self._started = True
        self._bar.set_description_str(f"{self.desc}: {text}" if self.desc else text)

    def close(self) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join(timeout=2.0)
            self._ticker = None
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> "Steps":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
