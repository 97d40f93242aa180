"""fastsync.procs: rank processes forked from a server that imported torch once, each taking its
caller's environment at its own start, and the spawn opt-out. Real processes, no stand-ins."""

from __future__ import annotations

import os

import pytest

from fastsync.errors import ConfigError
from fastsync.procs import START_ENV, rank_context, start_method
from fastsync_rigs.proc_probe import report

NAMES = ["FS_PROBE_A", "FS_PROBE_B"]


def _start(ctx, results) -> dict:
    p = ctx.Process(target=report, args=(results, NAMES), daemon=True)
    p.start()
    row = results.get(timeout=60)
    p.join(timeout=30)
    assert p.exitcode == 0
    return row


def test_forked_ranks_have_torch_and_each_takes_its_callers_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(START_ENV, raising=False)
    ctx = rank_context("forkserver")
    results = ctx.Queue()
    monkeypatch.setenv("FS_PROBE_A", "first")
    monkeypatch.delenv("FS_PROBE_B", raising=False)
    one = _start(ctx, results)  # the server starts here (or ran since an earlier test, with its environment)
    monkeypatch.setenv("FS_PROBE_A", "second")
    monkeypatch.setenv("FS_PROBE_B", "new")
    two = _start(ctx, results)
    monkeypatch.delenv("FS_PROBE_A")
    three = _start(ctx, results)
    assert one["env"] == {"FS_PROBE_A": "first", "FS_PROBE_B": None} and one["torch_loaded"] is True
    assert two["env"] == {"FS_PROBE_A": "second", "FS_PROBE_B": "new"}  # not the server's older environment
    assert three["env"] == {"FS_PROBE_A": None, "FS_PROBE_B": "new"}  # a variable unset since is unset there too
    assert len({one["pid"], two["pid"], three["pid"], os.getpid()}) == 4
    assert two["torch_loaded"] is True and three["torch_loaded"] is True  # preloaded: the target imports nothing for it


def test_spawn_opt_out_starts_a_fresh_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(START_ENV, "spawn")
    monkeypatch.setenv("FS_PROBE_A", "spawned")
    ctx = rank_context()
    assert ctx.method == "spawn"
    row = _start(ctx, ctx.Queue())
    assert row["env"]["FS_PROBE_A"] == "spawned" and row["torch_loaded"] is False


def test_default_and_a_bad_value_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(START_ENV, raising=False)
    assert start_method() == "forkserver"  # Linux has it
    monkeypatch.setenv(START_ENV, "fork")
    with pytest.raises(ConfigError, match=rf"{START_ENV}='fork'.*forkserver, spawn"):
        rank_context()
