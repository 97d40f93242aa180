"""The trace-event writer, validator and merger, and span recording in SyncMetrics."""

from __future__ import annotations

import json
import threading

import pytest

from fastsync.errors import ConfigError
from fastsync.executor.metrics import SyncMetrics
from fastsync.trace import chrome, enable, enabled


@pytest.fixture
def spans_on():
    was = enabled()
    enable()
    yield
    enable(was)


def test_metrics_record_nothing_while_tracing_is_off() -> None:
    assert not enabled()
    m = SyncMetrics(1, "trainer", 0, "nixl")
    with m.stage("post"):
        pass
    assert m.spans is None and "spans" not in m.to_json()
    assert m.stages["post"] >= 0


def test_metrics_spans_carry_stage_thread_and_add_up_to_stages(spans_on) -> None:
    m = SyncMetrics(3, "trainer", 1, "nixl")
    with m.stage("post"):
        sum(range(20000))

    def packer() -> None:
        for _ in range(3):
            with m.stage("pack"):
                sum(range(7001))

    th = threading.Thread(target=packer, name="fastsync-packer")
    th.start()
    th.join()
    spans = m.to_json()["spans"]
    assert [s["name"] for s in spans] == ["post", "pack", "pack", "pack"]
    assert {s["thread"] for s in spans if s["name"] == "pack"} == {"fastsync-packer"}
    assert spans[0]["thread"] == threading.current_thread().name
    for name in ("post", "pack"):
        total = sum(s["dur_ns"] for s in spans if s["name"] == name) / 1e9
        assert total == pytest.approx(m.stages[name], rel=1e-6)
    assert all(b["ts_ns"] >= a["ts_ns"] for a, b in zip(spans[1:], spans[2:]))


def _rows(version: int, start_s: float) -> list[dict]:
    """Two ranks' rows as SyncMetrics.to_json() gives them with spans on."""
    ns = int(start_s * 1e9)
    t = {"version": version, "role": "trainer", "rank": 0, "transport": "nixl", "start": start_s,
         "end": start_s + 0.010, "seconds": 0.010, "ok": True, "bytes_per_link": {"t0->r0": 1000},
         "spans": [{"name": "post", "ts_ns": ns + 1_000_000, "dur_ns": 4_000_000, "thread": "MainThread"},
                   {"name": "pack", "ts_ns": ns, "dur_ns": 3_000_000, "thread": "fastsync-packer"}]}
    e = {"version": version, "role": "engine", "rank": 0, "transport": "nixl", "start": start_s - 0.001,
         "end": start_s + 0.012, "seconds": 0.013, "ok": True, "bytes_per_link": {},
         "spans": [{"name": "wait", "ts_ns": ns, "dur_ns": 11_000_000, "thread": "MainThread"}]}
    return [t, e]


def test_builder_output_is_valid_one_process_per_rank_nested_slices() -> None:
    b = chrome.TraceBuilder(kind="measured")
    assert chrome.metrics_slices(b, _rows(1, 100.0) + _rows(2, 100.5)) == 4
    trace = json.loads(json.dumps(b.build()))
    events = chrome.validate(trace)
    assert chrome.process_names(trace) == {1: "trainer rank 0", 1_000_001: "engine rank 0"}
    xs = [e for e in events if e["ph"] == "X"]
    assert min(e["ts"] for e in xs) == 0  # origin: the earliest slice
    syncs = {(e["pid"], e["args"]["version"]): e for e in xs if e["name"].startswith("v")}
    assert syncs[(1, 1)]["dur"] == pytest.approx(10_000) and syncs[(1_000_001, 2)]["dur"] == pytest.approx(13_000)
    post = next(e for e in xs if e["name"] == "post" and e["args"]["version"] == 2)
    sync = syncs[(1, 2)]
    assert post["tid"] == sync["tid"] and sync["ts"] <= post["ts"] and post["ts"] + post["dur"] <= sync["ts"] + sync["dur"]
    pack = next(e for e in xs if e["name"] == "pack")
    assert pack["tid"] != post["tid"]  # the packer thread is its own row


@pytest.mark.parametrize("bad, field", [
    ({"events": []}, "traceEvents"),
    ({"traceEvents": [{"ph": "Q", "name": "x", "pid": 1, "tid": 1, "ts": 0}]}, "phase 'Q'"),
    ({"traceEvents": [{"ph": "X", "name": "x", "pid": 1, "tid": 1, "ts": 0}]}, "'dur'"),
    ({"traceEvents": [{"ph": "X", "name": "x", "pid": "1", "tid": 1, "ts": 0, "dur": 1}]}, "'pid'"),
    ({"traceEvents": [{"ph": "C", "name": "c", "pid": 0, "tid": 0, "ts": 1, "args": {"busy": "lots"}}]}, "counter"),
])
def test_validate_names_the_broken_event_and_field(bad: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        chrome.validate(bad, "t.json")


def test_merge_lines_files_up_on_the_wall_clock_and_keeps_metadata_once(tmp_path) -> None:
    a, b = chrome.TraceBuilder(), chrome.TraceBuilder()
    a.slice("trainer", 0, "main", "post", 1_000_000_000, 2_000_000)
    a.slice("engine", 0, "main", "wait", 1_000_500_000, 2_000_000)
    b.slice("trainer", 1, "main", "post", 1_003_000_000, 1_000_000)
    b.slice("engine", 0, "main", "wait", 1_003_000_000, 1_000_000)  # same process name as in a
    fa, fb = chrome.write(tmp_path / "a.json", a.build()), chrome.write(tmp_path / "b.json", b.build())
    merged = chrome.merge_files([fa, fb])
    chrome.validate(merged)
    xs = sorted((e["pid"], e["ts"]) for e in merged["traceEvents"] if e["ph"] == "X")
    assert xs == [(1, 0.0), (2, 3000.0), (1_000_001, 500.0), (1_000_001, 3000.0)]
    names = [e for e in merged["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"]
    assert len(names) == 3
    shifted = chrome.merge_files([fa, fb], offsets_ns={str(fb): -1_000_000})  # b's host clock ran 1 ms ahead
    assert sorted(e["ts"] for e in shifted["traceEvents"] if e["ph"] == "X" and e["pid"] == 2) == [2000.0]
    with pytest.raises(ConfigError, match="not merged"):
        chrome.merge_files([fa], offsets_ns={"elsewhere.json": 5})
    with pytest.raises(ConfigError, match="origin_unix_ns"):
        (tmp_path / "c.json").write_text(json.dumps({"traceEvents": []}))
        chrome.merge_files([tmp_path / "c.json"])


def test_unknown_role_and_missing_folder_are_refused(tmp_path) -> None:
    with pytest.raises(ConfigError, match="role"):
        chrome.pid_of("router", 0)
    with pytest.raises(ConfigError, match="does not exist"):
        chrome.write(tmp_path / "nope" / "t.json", chrome.TraceBuilder().build())
