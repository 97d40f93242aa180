"""``fastsync plan --trace/--plot``: the simulated schedule as a trace that ends where the
prediction does, one track per trainer and engine rank, and a figure of bytes per NIC."""

from __future__ import annotations

import json
from collections import defaultdict

import pytest

from fastsync.cli import main
from fastsync.trace import chrome

CASES = {
    # dense-ish MoE, bf16: NIC-bound on the receivers
    "bf16": ["--model", "qwen3-30b-a3b", "--trainer", "fsdp:24", "--rollout", "vllm:tp4,dp2,ep,replicas2"],
    # FP8 out: owner gathers (NVLink within 8-GPU nodes, NIC across) before gathered sends
    "fp8-gathers": ["--model", "qwen3-30b-a3b", "--trainer", "fsdp:24", "--rollout", "vllm:tp4", "--dtype-out", "fp8",
                    "--intra-node-gbps", "900"],
    # slow NVLink: the owner's gather then its gathered sends are the critical path
    "gather-chain": ["--model", "qwen3-30b-a3b", "--trainer", "fsdp:24", "--rollout", "vllm:tp4", "--dtype-out", "fp8",
                     "--intra-node-gbps", "20", "--nic-gbps", "3200"],
    # tiny transfers, slow posting: a posting-bound sender
    "posting": ["--model", "qwen3-0.6b", "--trainer", "fsdp:3", "--rollout", "vllm:tp2", "--max-transfer-mb", "0.01",
                "--nic-gbps", "3200"],
}

BOTTLENECK = {"bf16": "engine rank", "fp8-gathers": "engine rank", "gather-chain": "owner gather then send",
              "posting": "posting on trainer rank"}


def _plan(args: list[str], tmp_path, capsys) -> tuple[dict, dict]:
    path = tmp_path / "plan.json"
    assert main(["plan", *args, "--json", "--trace", str(path)]) == 0
    cap = capsys.readouterr()
    assert cap.err == ""  # --json: no progress on stderr
    report = json.loads(cap.out)
    trace = json.loads(path.read_text())
    chrome.validate(trace)
    return report, trace


@pytest.mark.parametrize("case", sorted(CASES))
def test_plan_trace_is_valid_one_track_per_rank_and_ends_at_the_prediction(case, tmp_path, capsys) -> None:
    r, trace = _plan(CASES[case], tmp_path, capsys)
    assert r["bottleneck"].startswith(BOTTLENECK[case])
    assert r["trace_file"] == str(tmp_path / "plan.json")
    names = chrome.process_names(trace)
    assert sorted(v for v in names.values() if v.startswith("trainer")) == sorted(
        f"trainer rank {i}" for i in range(r["num_trainers"]))
    assert sorted(v for v in names.values() if v.startswith("engine")) == sorted(
        f"engine rank {i}" for i in range(r["num_receivers"]))
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    pred_us = r["predicted_seconds"] * 1e6
    total = [e for e in xs if e["name"] == "predicted sync"]
    assert len(total) == 1 and total[0]["dur"] == pytest.approx(pred_us)
    # the schedule's last slice (the completion signal) ends where the simulator's number does
    end = max(e["ts"] + e["dur"] for e in xs if e["name"] != "predicted sync")
    assert end == pytest.approx(pred_us, rel=0.05)
    # each rank's track: its slices add up to its bytes at the effective rate, back to back
    by_row: dict[tuple[int, int], list[dict]] = defaultdict(list)
    for e in xs:
        by_row[(e["pid"], e["tid"])].append(e)
    for row in by_row.values():
        row.sort(key=lambda e: e["ts"])
        assert all(a["ts"] + a["dur"] <= b["ts"] + 1e-3 for a, b in zip(row, row[1:]))  # no overlap within a row
    engine_bytes = defaultdict(int)
    for e in xs:
        if names[e["pid"]].startswith("engine"):
            engine_bytes[e["pid"]] += e["args"]["bytes"]
    assert max(engine_bytes.values()) == r["max_recv_bytes"]
    busiest = max(sum(e["dur"] for e in row) for (pid, _), row in by_row.items() if pid != 0)
    assert busiest <= pred_us and busiest == pytest.approx(pred_us, rel=0.05)  # the bottleneck port fills the sync
    counters = [e for e in trace["traceEvents"] if e["ph"] == "C"]
    assert counters and counters[-1]["args"]["busy"] == 0.0


def test_plan_trace_groups_transfers_so_big_plans_stay_openable(tmp_path, capsys) -> None:
    r, trace = _plan(CASES["posting"], tmp_path, capsys)
    per_row = defaultdict(int)
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            per_row[(e["pid"], e["tid"])] += 1
    assert r["transfers"] > 64 * r["num_trainers"]  # more transfers than slices allowed
    assert max(per_row.values()) <= 64
    assert sum(e["args"].get("transfers", 0) for e in trace["traceEvents"]
               if e["ph"] == "X" and chrome.process_names(trace)[e["pid"]].startswith("engine")) == r["transfers"]


def test_plan_plot_writes_a_png(tmp_path, capsys) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "nics.png"
    assert main(["plan", *CASES["bf16"], "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert f"figure               {png}" in out
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


@pytest.mark.parametrize("flag, value, msg", [("--trace", "plan.txt", "must end in .json"),
                                              ("--plot", "plan.gif", "must end in .png"),
                                              ("--trace", "missing/plan.json", "does not exist")])
def test_bad_output_paths_fail_before_planning(flag, value, msg, tmp_path, capsys) -> None:
    assert main(["plan", *CASES["bf16"], flag, str(tmp_path / value)]) == 2
    assert msg in capsys.readouterr().err


def test_progress_draws_on_a_terminal_and_not_otherwise(capsys) -> None:
    import io

    from fastsync.trace.progress import Steps, auto

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty = Tty()
    assert auto(stream=tty) and not auto(stream=tty, json=True) and not auto(stream=io.StringIO())
    assert auto(stream=io.StringIO(), force=True)
    with Steps(["a", "b"], enabled=auto(stream=tty), desc="plan", stream=tty) as s:
        s.next("layouts")
        s.next("simulating")
    assert "plan: layouts" in tty.getvalue() and "simulating" in tty.getvalue()
    quiet = io.StringIO()
    with Steps(2, enabled=auto(stream=quiet), stream=quiet) as s:
        s.next("x")
    assert quiet.getvalue() == ""


def test_plan_names_its_steps_on_a_terminal(monkeypatch, capsys) -> None:
    import io
    import sys

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty = Tty()
    monkeypatch.setattr(sys, "stderr", tty)
    assert main(["plan", *CASES["bf16"]]) == 0
    shown = tty.getvalue()
    assert "fastsync plan: planning" in shown and "simulating" in shown
    assert "predicted sync" in capsys.readouterr().out  # the table itself stays on stdout
    import threading

    assert not [t for t in threading.enumerate() if t.name == "fastsync-progress"]  # the ticker stopped
