"""Which ``multiprocessing`` processes a command starts, and the CPU each spends before its target
runs: the measurement in docs/benchmarks.md#the-test-suite (how much of the suite's CPU is new
processes importing vLLM or torch again).

    SPAWN_LOG_DIR=runs/spawns PYTHONPATH=scripts/spawn_log make test
    .venv/bin/python scripts/spawn_log/sitecustomize.py runs/spawns

On ``PYTHONPATH`` this file is Python's ``sitecustomize``: every Python process the command starts
(pytest workers, engine cores, Ray workers, job processes; the suite keeps ``PYTHONPATH``) imports
it at start-up. With ``SPAWN_LOG_DIR`` set it appends one line per ``Process.start()`` (the
target, the start method, the test running then) to ``starts.tsv``, and one per child when its
target is about to run (``time.process_time()`` so far: mostly the imports that unpickling the
target needed) to ``children.tsv``. Run as a script, it prints both summed by target. Without
``SPAWN_LOG_DIR`` it does nothing. A test rig's measurement; fastsync does not import it."""

from __future__ import annotations

import os
import sys
import time


def _log(name: str, fields: list[str]) -> None:
    try:
        with open(os.path.join(os.environ["SPAWN_LOG_DIR"], name), "a") as f:
            f.write("\t".join(fields) + "\n")
    except Exception:  # noqa: BLE001 - a measurement never breaks the command
        pass


def _target(proc: object) -> str:
    t = getattr(proc, "_target", None)
    return f"{getattr(t, '__module__', '?')}:{getattr(t, '__qualname__', '?')}"


def _install() -> None:
    import multiprocessing.process as mpp

    start, bootstrap = mpp.BaseProcess.start, mpp.BaseProcess._bootstrap

    def logged_start(self: mpp.BaseProcess) -> None:
        _log("starts.tsv", [f"{time.time():.1f}", str(os.getpid()), type(self).__name__, _target(self),
                            os.environ.get("PYTEST_CURRENT_TEST", "-").split("::")[0]])
        start(self)

    def logged_bootstrap(self: mpp.BaseProcess, *args: object, **kwargs: object) -> int:
        _log("children.tsv", [str(os.getpid()), _target(self), f"{time.process_time():.2f}"])
        return bootstrap(self, *args, **kwargs)

    mpp.BaseProcess.start = logged_start  # type: ignore[method-assign]
    mpp.BaseProcess._bootstrap = logged_bootstrap  # type: ignore[method-assign]


def summarize(folder: str) -> None:
    import collections

    starts: collections.Counter = collections.Counter()
    for line in open(os.path.join(folder, "starts.tsv")):
        _, _, kind, target, module = line.rstrip("\n").split("\t")
        starts[(target, kind)] += 1
    cpu: dict[str, list[float]] = collections.defaultdict(list)
    for line in open(os.path.join(folder, "children.tsv")):
        _, target, seconds = line.rstrip("\n").split("\t")
        cpu[target].append(float(seconds))
    print(f"{'target':64} {'method':18} {'starts':>6} {'CPU before target, s':>21} {'each':>6}")
    for (target, kind), n in starts.most_common():
        got = cpu.get(target, [])
        each = f"{sum(got) / len(got):6.2f}" if got else "     -"
        print(f"{target[:64]:64} {kind:18} {n:6d} {sum(got):21.1f} {each}")


if __name__ == "__main__":
    summarize(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("SPAWN_LOG_DIR", "."))
elif os.environ.get("SPAWN_LOG_DIR"):
    try:
        _install()
    except Exception:  # noqa: BLE001
        pass
