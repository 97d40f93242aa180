"""Real FSDP2 on CPU (gloo, 2 processes, tiny transformers-v5 Qwen3-MoE): the layout read from
DTensor placements equals ``fsdp_layout`` and every rank's local tensor is full[box].
The ranks run ``fsdp2_worker.py`` in their own interpreters."""

from __future__ import annotations

import json
import os
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

WORLD = 2
WORKER = os.path.join(os.path.dirname(__file__), "fsdp2_worker.py")


@pytest.mark.slow
def test_fsdp2_dtensor_layout_matches_fsdp_layout(tmp_path, free_port, run_workers):
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    outputs = run_workers([[sys.executable, WORKER, str(r), str(port), str(tmp_path)] for r in range(WORLD)],
                          env, timeout_s=180, tail_chars=3000)
    results = []
    for r in range(WORLD):
        path = tmp_path / f"rank{r}.json"
        assert path.exists(), f"rank {r} wrote no result (exit {procs[r].returncode}):\n{outputs[r]}"
        results.append(json.loads(path.read_text()))
    for res in results:
        assert res["ok"], res.get("error")
        assert res["checked"] > 20
    # 5 experts over 2 ranks in torch.chunk order: 3 + 2
    assert results[0]["experts"] == [[[0, 3], [0, 96], [0, 64]], [[3, 5], [0, 96], [0, 64]]]
    # shard_placement_fn Shard(1) for >= 2-D params: experts split on their 2*I dim
    assert results[0]["experts_dim1"] == [[[0, 5], [0, 48], [0, 64]], [[0, 5], [48, 96], [0, 64]]]
