"""``examples/verl/sync_smoke.py --json`` end to end: verl's FSDP2 export on two real trainer
processes -> fastsync in-place writes -> a real vLLM CPU engine running the composed extension
(verl's + fastsync's). What in it is verl's and what is a stand-in is listed in the script."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="vLLM not installed")
pytest.importorskip("verl.workers.engine.fsdp.transformer_impl", reason="verl's FSDP engine does not import")
pytest.importorskip("nixl._api", reason="NIXL not installed")

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "verl", "sync_smoke.py")


@pytest.mark.slow
def test_smoke_matches_in_place_without_full_tensor(tmp_path) -> None:
    out = subprocess.run([sys.executable, SCRIPT, "--json"], capture_output=True, text=True, timeout=900,
                         cwd=tmp_path, env={**os.environ, "TMPDIR": str(tmp_path)})
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    assert lines, out.stderr[-3000:]
    res = json.loads(lines[-1])
    assert out.returncode == 0, res
    assert res["match"] is True and res["changed"] is True  # greedy tokens after the sync = the trainer's
    assert res["inplace"] is True and res["engine_version"] == 1
    assert res["trainer_full_tensor_calls"] == 0 and res["verl_generator_iterated"] is False
    assert res["extension"] == "fastsync_verl.extension.FastSyncVerlWorkerExtension"
