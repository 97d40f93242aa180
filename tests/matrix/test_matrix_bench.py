"""The sync matrix through ``fastsync bench``: real trainer and engine processes over NIXL, two
identical tp1 engines (``--rollouts 2 --replicas 2``), every receiver compared byte for byte with
an independent reference (``--check-exact``); delta cells run ``--delta`` (a seeded 1% of the weights
changes per version). The bench moves a synthetic model between its own processes, so there are no
engine tokens to compare: bytes only. Cells: see ``matrix_support``."""

from __future__ import annotations

import json
import os
import sys

import pytest

pytest.importorskip("nixl._api", reason="NIXL not installed")

sys.path.insert(0, os.path.dirname(__file__))
from matrix_support import CELLS, FANOUT, cell_id  # noqa: E402

from fastsync.cli import main  # noqa: E402

pytestmark = pytest.mark.slow

def _cells():
    for cell in CELLS:
        yield pytest.param(cell, id=cell_id(cell))


@pytest.mark.parametrize("cell", list(_cells()))
def test_bench_matrix(cell, capsys: pytest.CaptureFixture[str]) -> None:
    payload, route = cell
    argv = ["bench", "--trainers", "2", "--rollouts", "2", "--replicas", "2", "--fanout", FANOUT[route],
            "--size-gb", "0.002", "--transport", "nixl", "--steps", "2", "--check-exact", "--json",
            "--progress", "off", "--timeout", "60"]
    if payload == "delta":  # a seeded 1% of the weights changes per version; dense first, then deltas
        argv.append("--delta")
    rc = main(argv)
    cap = capsys.readouterr()
    assert rc == 0, cap.err[-2000:]
    out = json.loads(cap.out)
    assert out["error"] is None, out["error"]
    r = out["transports"]["nixl"]
    assert r["verified"] is True and r["exact"] is True, r["errors"]  # every receiver equals the reference
    assert out["replicas"] == 2 and out["fanout"] == FANOUT[route]
    # what one replica gets from the trainer ranks: the whole shard dense, a small stream as a delta
    per_replica = out["trainer_shard_bytes_max"] if payload == "dense" else None
    if payload == "delta":
        assert r["payload"] == "delta" and 0 < r["delta_bytes_ratio"] < 0.2, r
        per_replica = r["delta_bytes_ratio"] * out["trainer_shard_bytes_max"] * 1.5  # streams carry record headers
    else:
        assert r["payload"] == "dense" and r["delta_bytes_ratio"] is None
    if route == "relayed":  # the trainer ranks wrote the first replica only; engine ranks relayed the rest
        assert r["relayed_bytes"] > 0 and r["trainer_egress_bytes_max"] <= 1.05 * per_replica
    else:
        assert r["relayed_bytes"] == 0
        if payload == "dense":
            assert r["trainer_egress_bytes_max"] >= 1.9 * per_replica
