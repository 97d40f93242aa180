"""``fastsync delta-bench``'s summary: a sync only some engine ranks reported on is not verified
(every rank must have checked it after the clock), and neither is the run."""

from __future__ import annotations

from types import SimpleNamespace

from fastsync.bench.delta import DeltaBenchConfig, _summarise


def _rows(engine_rows_of_v3: int) -> list[dict]:
    rows = [{"kind": "trainer", "step": 0, "params": 10, "row": {"version": 1}},
            {"kind": "trainer", "step": 1, "loss": 1.0, "rows": [
                {"version": 2, "start": 0.0, "changed": 1, "elements": 100, "bytes_sent": 10, "stages": {}},
                {"version": 3, "start": 1.0, "changed": 100, "elements": 100, "bytes_sent": 400, "stages": {}}]}]
    for v in (1, 2, 3):
        for rank in range(2 if v != 3 else engine_rows_of_v3):
            rows.append({"kind": "engine", "rank": rank, "version": v, "end": v + 0.5, "verified": True, "stages": {}})
    return rows


def test_every_engine_rank_must_verify_every_sync() -> None:
    cfg = DeltaBenchConfig(model="qwen3-0.6b", steps=1, rollouts=2)
    plan = SimpleNamespace(bytes_total=400)
    ok = _summarise(cfg, {}, plan, _rows(2))
    assert ok["steps"][0]["verified"] and ok["summary"]["verified"]
    short = _summarise(cfg, {}, plan, _rows(1))  # the dense sync of step 1: one of two engine ranks reported
    assert not short["steps"][0]["verified"] and not short["summary"]["verified"]
