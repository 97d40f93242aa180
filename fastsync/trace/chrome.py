"""Chrome trace-event JSON: the format Perfetto (ui.perfetto.dev), chrome://tracing and the PyTorch
profiler use. One process per rank (``trainer rank 3``, ``engine rank 0``, plus ``sync`` for the
whole-sync slices and counters of a predicted trace), one thread per activity within the rank.

Predicted (``fastsync plan --trace``) and measured (``fastsync bench --trace``,
``WeightSync(trace_dir=...)``) traces use the same process ids and names, so the two files open
side by side (Perfetto: open both; chrome://tracing: load one after the other).

Times are written in microseconds from the trace's origin; ``otherData.origin_unix_ns`` keeps the
origin on the wall clock, which is what :func:`merge_files` lines per-process files up by.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from fastsync.errors import ConfigError

__all__ = ["TraceBuilder", "pid_of", "metrics_slices", "validate", "load", "write", "merge_files", "process_names",
           "FORMAT"]

FORMAT = "fastsync-trace/1"
_ROLE_BASE = {"sync": 0, "trainer": 1, "engine": 1_000_001}


def pid_of(role: str, rank: int) -> int:
    """Process id of a rank's track, the same in predicted and measured traces."""
    if role not in _ROLE_BASE:
        raise ConfigError(f"trace role must be one of {sorted(_ROLE_BASE)}, got {role!r}")
    return _ROLE_BASE[role] + (0 if role == "sync" else int(rank))


def _label(role: str, rank: int) -> str:
    return "sync" if role == "sync" else f"{role} rank {rank}"


class TraceBuilder:
    """Collects slices (``ph: X``) and counters (``ph: C``) stamped in nanoseconds, then writes them
    relative to one origin. Threads get ids in order of first use within their process."""

    def __init__(self, **other: Any) -> None:
        self.other = dict(other)
        self._slices: list[tuple[int, str, str, int, int, dict | None]] = []
        self._counters: list[tuple[int, str, int, dict]] = []
        self._procs: dict[int, str] = {}

    def slice(self, role: str, rank: int, thread: str, name: str, start_ns: int, dur_ns: int,
              args: Mapping[str, Any] | None = None) -> None:
        pid = pid_of(role, rank)
        self._procs.setdefault(pid, _label(role, rank))
        self._slices.append((pid, thread, name, int(start_ns), max(0, int(dur_ns)), dict(args) if args else None))

    def counter(self, name: str, t_ns: int, values: Mapping[str, float], role: str = "sync", rank: int = 0) -> None:
        pid = pid_of(role, rank)
        self._procs.setdefault(pid, _label(role, rank))
        self._counters.append((pid, name, int(t_ns), {k: float(v) for k, v in values.items()}))

    @property
    def num_slices(self) -> int:
        return len(self._slices)

    def build(self, origin_ns: int | None = None) -> dict:
        starts = [s[3] for s in self._slices] + [c[2] for c in self._counters]
        origin = origin_ns if origin_ns is not None else (min(starts) if starts else 0)
        events: list[dict] = []
        tids: dict[tuple[int, str], int] = {}
        for pid, label in sorted(self._procs.items()):
            events.append({"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": label}})
            events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0, "args": {"sort_index": pid}})
        body: list[dict] = []
        for pid, thread, name, start, dur, args in sorted(self._slices, key=lambda s: (s[0], s[3], -s[4])):
            tid = tids.get((pid, thread))
            if tid is None:
                tid = tids[(pid, thread)] = 1 + sum(1 for p, _ in tids if p == pid)
                events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": thread}})
            ev = {"ph": "X", "name": name, "pid": pid, "tid": tid, "ts": (start - origin) / 1e3, "dur": dur / 1e3}
            if args:
                ev["args"] = args
            body.append(ev)
        for pid, name, t, values in sorted(self._counters, key=lambda c: c[2]):
            body.append({"ph": "C", "name": name, "pid": pid, "tid": 0, "ts": (t - origin) / 1e3, "args": values})
        return {"traceEvents": events + body, "displayTimeUnit": "ms",
                "otherData": {"format": FORMAT, "origin_unix_ns": origin, **self.other}}


def metrics_slices(builder: TraceBuilder, rows: Iterable[Mapping[str, Any]]) -> int:
    """Add the measured phases of ``SyncMetrics.to_json()`` rows (recorded with spans on): one
    ``v{version} {transport}`` slice per rank and sync from its start to its end, holding that
    rank's phases (``pack`` on the packer thread, ``post``/``drain``/``wait_*`` on the caller's,
    ``backup``/``wait``/``verify``/``apply`` on an engine rank). Returns the rows used."""
    n = 0
    for r in rows:
        spans = r.get("spans")
        if spans is None or r.get("role") not in ("trainer", "engine"):
            continue
        start, end = int(r["start"] * 1e9), int(r["end"] * 1e9)
        if spans:  # the two clocks differ by the anchor's drift: keep the phases inside their sync
            start = min(start, min(s["ts_ns"] for s in spans))
            end = max(end, max(s["ts_ns"] + s["dur_ns"] for s in spans))
        main = spans[0]["thread"] if spans else "main"
        args = {"version": r["version"], "transport": r.get("transport"), "ok": r.get("ok"),
                "seconds": r.get("seconds"), "bytes": sum(r.get("bytes_per_link", {}).values())}
        if r.get("error"):
            args["error"] = r["error"]
        builder.slice(r["role"], r["rank"], main, f"v{r['version']} {r.get('transport', '')}".strip(),
                      start, end - start, args)
        for s in spans:
            builder.slice(r["role"], r["rank"], s["thread"], s["name"], s["ts_ns"], s["dur_ns"],
                          {"version": r["version"]})
        n += 1
    return n


_PH = {"X", "M", "C", "B", "E", "i", "I"}


def validate(obj: Any, where: str = "trace") -> list[dict]:
    """Check ``obj`` is trace-event JSON as Perfetto reads it (object form); returns the events.
    Raises ConfigError naming the event and field otherwise."""
    if not isinstance(obj, dict) or not isinstance(obj.get("traceEvents"), list):
        raise ConfigError(f"{where}: not a trace-event object (no 'traceEvents' list)")
    for i, ev in enumerate(obj["traceEvents"]):
        if not isinstance(ev, dict):
            raise ConfigError(f"{where}: event {i} is not an object")
        ph = ev.get("ph")
        if ph not in _PH:
            raise ConfigError(f"{where}: event {i}: phase {ph!r} is not one of {sorted(_PH)}")
        if not isinstance(ev.get("name"), str):
            raise ConfigError(f"{where}: event {i}: 'name' must be a string")
        for key in ("pid", "tid"):
            if not isinstance(ev.get(key), int):
                raise ConfigError(f"{where}: event {i} ({ev['name']}): '{key}' must be an integer")
        if ph != "M":
            ts = ev.get("ts")
            if not isinstance(ts, (int, float)) or ts < 0:
                raise ConfigError(f"{where}: event {i} ({ev['name']}): 'ts' must be a number >= 0, got {ts!r}")
        if ph == "X":
            dur = ev.get("dur")
            if not isinstance(dur, (int, float)) or dur < 0:
                raise ConfigError(f"{where}: event {i} ({ev['name']}): 'dur' must be a number >= 0, got {dur!r}")
        if ph == "C" and not (isinstance(ev.get("args"), dict)
                              and all(isinstance(v, (int, float)) for v in ev["args"].values())):
            raise ConfigError(f"{where}: event {i} ({ev['name']}): a counter's 'args' must map names to numbers")
    return obj["traceEvents"]


def process_names(obj: Mapping[str, Any]) -> dict[int, str]:
    """pid -> process name (the rank's track label)."""
    return {e["pid"]: e["args"]["name"] for e in obj["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"}


def write(path: str | Path, trace: Mapping[str, Any]) -> Path:
    p = Path(path)
    if p.parent and not p.parent.exists():
        raise ConfigError(f"trace file {p}: folder {p.parent} does not exist")
    p.write_text(json.dumps(trace, separators=(",", ":")))
    return p


def load(path: str | Path) -> dict:
    try:
        obj = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"trace file {path}: {e}") from e
    validate(obj, str(path))
    return obj


def merge_files(paths: Sequence[str | Path], offsets_ns: Mapping[str, int] | None = None) -> dict:
    """Merge per-process trace files onto one clock: each file's times are shifted by its
    ``origin_unix_ns`` (plus ``offsets_ns[str(path)]``, a known clock offset of that file's host)
    relative to the earliest origin. Metadata events are kept once."""
    if not paths:
        raise ConfigError("merge_files: no trace files given")
    offsets = dict(offsets_ns or {})
    loaded = []
    for p in paths:
        obj = load(p)
        origin = obj.get("otherData", {}).get("origin_unix_ns")
        if not isinstance(origin, int):
            raise ConfigError(f"trace file {p}: no otherData.origin_unix_ns (not written by fastsync?)")
        loaded.append((obj, origin + int(offsets.pop(str(p), 0))))
    if offsets:
        raise ConfigError(f"merge_files: offsets for files not merged: {sorted(offsets)}")
    origin = min(o for _, o in loaded)
    seen: set[str] = set()
    meta, body = [], []
    for obj, o in loaded:
        shift_us = (o - origin) / 1e3
        for ev in obj["traceEvents"]:
            if ev["ph"] == "M":
                key = json.dumps(ev, sort_keys=True)
                if key not in seen:
                    seen.add(key)
                    meta.append(ev)
            else:
                body.append({**ev, "ts": ev["ts"] + shift_us})
    body.sort(key=lambda e: e["ts"])
    return {"traceEvents": meta + body, "displayTimeUnit": "ms",
            "otherData": {"format": FORMAT, "origin_unix_ns": origin, "merged_from": [str(p) for p in paths]}}
