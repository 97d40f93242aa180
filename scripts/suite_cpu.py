"""Where a command's CPU goes, by kind of process: the measurement in
docs/benchmarks.md#the-test-suite (why the suite takes as long as it does on 2 cores).

    .venv/bin/python scripts/suite_cpu.py -- make test PYTEST_ARGS="--junitxml=runs/suite.xml"

Runs the command and, every 0.5 s until it ends, reads ``/proc`` for every process on the machine
that started after it (a process watch, not a tracer: a process living under 0.5 s is missed, and
each one's CPU is its user + system time at its last sighting). Then prints one row per kind of
process (pytest, its ``multiprocessing`` spawns and theirs, spawns under job processes, Ray workers
and what they spawn, Ray's daemons, vLLM's model-info subprocess, the rest): count, CPU seconds,
median per process; and the command's wall time and exit status. Linux only."""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import time

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _read(pid: str) -> tuple[int, int, float, str] | None:
    """(parent pid, start time in ticks since boot, CPU seconds, command line) of one process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    rest = stat[stat.rfind(")") + 2:].split()
    return int(rest[1]), int(rest[19]), (int(rest[11]) + int(rest[12])) / TICK, cmd or stat[stat.find("(") + 1:stat.rfind(")")]


def watch(argv: list[str], every_s: float = 0.5) -> tuple[dict, int, float]:
    """Run ``argv``; the processes seen while it ran, keyed (pid, start), and its status and wall time."""
    before = {p for p in os.listdir("/proc") if p.isdigit()}  # this process among them
    seen: dict[tuple[int, int], dict] = {}
    t0 = time.monotonic()
    proc = subprocess.Popen(argv)
    while True:
        done = proc.poll() is not None
        for pid in os.listdir("/proc"):
            if not pid.isdigit() or pid in before:
                continue
            got = _read(pid)
            if got is None:
                continue
            ppid, start, cpu, cmd = got
            row = seen.setdefault((int(pid), start), {"pid": int(pid), "ppid": ppid, "start": start, "cmd": cmd[:300]})
            row["cpu"] = cpu
        if done:
            return seen, proc.returncode, time.monotonic() - t0
        time.sleep(every_s)


def _kind(cmd: str) -> str:
    if "exec(eval(sys.stdin" in cmd or "pytest" in cmd.split(" -", 1)[0] or " -m pytest" in cmd:
        return "pytest"
    if "spawn_main" in cmd:
        return "spawn"
    if "default_worker.py" in cmd:
        return "ray worker"
    if any(d in cmd for d in ("raylet", "gcs_server", "ray/dashboard", "log_monitor", "monitor.py", "runtime_env/agent")):
        return "ray daemon"
    if "model_executor.models.registry" in cmd:
        return "vLLM model-info subprocess"
    return "python job" if "python" in cmd else "other"


def summary(seen: dict) -> list[tuple[str, int, float, float]]:
    """Rows (kind, count, CPU seconds, median) by kind, a spawn named by what spawned it."""
    by_pid = {r["pid"]: r for r in seen.values()}

    def kind(r: dict) -> str:
        k = _kind(r["cmd"])
        if k != "spawn":
            return k
        chain, p = [], by_pid.get(r["ppid"])
        while p is not None and len(chain) < 12:
            chain.append(_kind(p["cmd"]))
            p = by_pid.get(p["ppid"])
        if chain[:1] == ["pytest"]:
            return "spawn of a pytest worker"
        if chain[:2] == ["spawn", "pytest"]:
            return "spawn of such a spawn"
        return "spawn under a Ray worker" if "ray worker" in chain else "spawn under a job process"

    groups: dict[str, list[float]] = collections.defaultdict(list)
    for r in seen.values():
        groups[kind(r)].append(r.get("cpu", 0.0))
    rows = [(k, len(v), sum(v), sorted(v)[len(v) // 2]) for k, v in groups.items()]
    return sorted(rows, key=lambda row: -row[2])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, after --")
    a = ap.parse_args(argv)
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd:
        ap.error("give the command to watch after --")
    seen, rc, wall = watch(cmd)
    rows = summary(seen)
    total = sum(r[2] for r in rows)
    print(f"\n{' '.join(cmd)}: exit {rc}, {wall:.0f} s wall, {total:.0f} CPU-s in {len(seen)} processes "
          f"({os.cpu_count()} CPUs: {total / max(wall, 1e-9):.2f} busy on average)")
    print(f"{'processes':<30} {'count':>6} {'CPU s':>8} {'median':>7}")
    for k, n, cpu, med in rows:
        print(f"{k:<30} {n:>6} {cpu:>8.0f} {med:>7.1f}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
