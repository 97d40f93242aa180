"""``fastsync demo`` exits non-zero when fastsync's or the rank-0 baseline's result does not equal
the trainer's, with ``--json`` as without it. The demo itself is a stand-in here (a canned report:
the real one starts a vLLM engine, run by tests/test_wheel.py); the verdict is the CLI's."""

from __future__ import annotations

import json

import pytest

from fastsync.cli import main

A, B = [[1, 2]], [[3, 4]]


def _report(baseline_engine: list) -> dict:
    return {"before_engine": A, "after_engine": B, "after_trainer": B, "version_before": 0, "version_after": 1,
            "sync_s_max_over_ranks": {"fastsync": [0.1], "baseline": [0.3]}, "after2_engine": baseline_engine,
            "after2_trainer": [[5, 6]], "engine_start_s": 1.0, "setup_s": 1.0}


@pytest.mark.parametrize("as_json", [True, False])
@pytest.mark.parametrize("baseline_engine, want_rc", [([[5, 6]], 0), ([[9, 9]], 1)])
def test_demo_exit_code_covers_the_baseline(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                                            as_json: bool, baseline_engine: list, want_rc: int) -> None:
    import fastsync.demo.run as demo_run

    monkeypatch.setattr(demo_run, "run_demo", lambda **_: _report(baseline_engine))  # stand-in for the real demo
    rc = main(["demo"] + (["--json"] if as_json else []))
    out = capsys.readouterr().out
    assert rc == want_rc, out
    if as_json:
        s = json.loads(out)["summary"]
        assert s["ok"] is (want_rc == 0) and s["baseline_match"] is (want_rc == 0)
        assert "NCCLCheckpointEngine.send_weights" in s["baseline_mirrors"]  # the host function it stands for
    else:
        assert f"match: {str(want_rc == 0).lower()}" in out
        assert "mirrors verl NCCLCheckpointEngine.send_weights" in out
