"""``fastsync trace merge|check|plot`` and the per-rank files of ``WeightSync(trace_dir=)``."""

from __future__ import annotations

import json

import pytest

from fastsync.cli import main
from fastsync.errors import ConfigError
from fastsync.sync.trace_dir import TraceDir, merge_trace_dir
from fastsync.trace import chrome, enable, enabled


def _row(role: str, rank: int, version: int, start_s: float, dur_s: float) -> dict:
    ns = int(start_s * 1e9)
    return {"version": version, "role": role, "rank": rank, "transport": "nixl", "start": start_s,
            "end": start_s + dur_s, "seconds": dur_s, "ok": True, "bytes_per_link": {},
            "spans": [{"name": "post" if role == "trainer" else "wait", "ts_ns": ns, "dur_ns": int(dur_s * 0.9e9),
                       "thread": "MainThread"}]}


@pytest.fixture
def trace_dir(tmp_path):
    was = enabled()
    # two trainer ranks' files as WeightSync writes them; rank 0 with its engine's rows
    t0, t1 = TraceDir(tmp_path, 0, max_syncs=2), TraceDir(tmp_path, 1, max_syncs=2)
    assert enabled()  # a TraceDir turns span recording on in its process
    for v in (1, 2, 3):
        engine_results = [[{"rank": 0, "wait_s": 0.01, "sync": _row("engine", 0, v, 10.0 * v - 0.001, 0.012)},
                           {"rank": 1, "wait_s": 0.01}]]  # a worker that recorded no spans
        t0.record(_row("trainer", 0, v, 10.0 * v, 0.010), engine_results)
        t1.record(_row("trainer", 1, v, 10.0 * v + 0.002, 0.008), [])
    yield tmp_path
    enable(was)


def test_trace_dir_keeps_the_last_syncs_per_rank_and_merges_onto_one_clock(trace_dir) -> None:
    r0 = chrome.load(trace_dir / "trainer0.json")
    assert sorted(chrome.process_names(r0).values()) == ["engine rank 0", "trainer rank 0"]
    versions = {e["args"]["version"] for e in r0["traceEvents"] if e["ph"] == "X"}
    assert versions == {2, 3}  # max_syncs=2
    merged = chrome.load(merge_trace_dir(trace_dir))
    tops = {(chrome.process_names(merged)[e["pid"]], e["args"]["version"]): e
            for e in merged["traceEvents"] if e["ph"] == "X" and e["name"] == f"v{e['args']['version']} nixl"}
    # trainer rank 1 started 2 ms after rank 0 in both files' wall clocks: so in the merged one
    assert tops[("trainer rank 1", 3)]["ts"] - tops[("trainer rank 0", 3)]["ts"] == pytest.approx(2000, abs=1)
    assert tops[("engine rank 0", 3)]["ts"] - tops[("trainer rank 0", 3)]["ts"] == pytest.approx(-1000, abs=1)
    with pytest.raises(ConfigError, match="not an existing folder"):
        TraceDir(trace_dir / "missing", 0)


def test_trace_cli_merges_checks_and_plots(trace_dir, tmp_path, capsys) -> None:
    out = tmp_path / "run.json"
    assert main(["trace", "merge", str(trace_dir), "-o", str(out)]) == 0
    assert main(["trace", "check", str(out), "--json"]) == 0
    got = json.loads(capsys.readouterr().out.splitlines()[-1])[str(out)]
    assert got["tracks"] == ["engine rank 0", "trainer rank 0", "trainer rank 1"]
    assert got["seconds"] == pytest.approx(10.012, abs=1e-6)  # v2's engine at 19.999 s to v3's end at 30.011 s
    pytest.importorskip("matplotlib")
    png = tmp_path / "run.png"
    assert main(["trace", "plot", str(out), "-o", str(png), "--versions", "3"]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert main(["trace", "plot", str(out), "-o", str(png), "--versions", "99"]) == 2
    assert "no slices" in capsys.readouterr().err
    assert main(["trace", "check", str(tmp_path / "nope.json")]) == 2
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"traceEvents": [{"ph": "X", "name": "x", "pid": 1, "tid": 1, "ts": -1, "dur": 1}]}))
    assert main(["trace", "check", str(bad)]) == 2
    assert "event 0 (x): 'ts'" in capsys.readouterr().err
