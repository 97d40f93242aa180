"""After a flip, an engine whose core runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) does
not reuse prefix-cached KV computed by the old weights: ``VllmEngine`` resets vLLM's prefix cache
at the flip, as ``pause_scheduler(clear_cache=True)`` does for a core in its own process. A real
vLLM CPU engine with prefix caching, in a subprocess (``prefix_cache_job.py``), with a control
sync that skips the reset to show the cache is really hit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("vllm")
pytest.importorskip("nixl")

from fastsync.demo.checkpoints import build_tiny_checkpoint  # noqa: E402

pytestmark = pytest.mark.slow

JOB = str(Path(__file__).with_name("prefix_cache_job.py"))


def test_flip_drops_the_prefix_cache_of_an_in_process_engine(tmp_path):
    ckpt = build_tiny_checkpoint("tiny-qwen3", tmp_path / "tiny-qwen3")
    p = subprocess.run([sys.executable, JOB, str(ckpt)], capture_output=True, text=True, timeout=600)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    assert p.returncode == 0 and lines, (p.returncode, p.stdout[-3000:], p.stderr[-5000:])
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["prompt_len"] > 2 * out["block_size"]  # two full blocks of the prompt can be cached
    v1, v2 = out["v1"], out["v2"]
    # the control (no reset at the flip): the new weights landed (an unseen prompt is the new
    # model's), but the cached prompt reused the old weights' KV
    assert v1["version"] == 1 and v1["fresh_engine"] == v1["fresh_trainer"], v1
    assert v1["engine"] != v1["trainer"], v1
    # as shipped: the flip dropped the cache
    assert v2["version"] == 2 and v2["engine"] == v2["trainer"] and v2["fresh_engine"] == v2["fresh_trainer"], v2
