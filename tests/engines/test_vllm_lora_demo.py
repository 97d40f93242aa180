"""``examples/vllm_sync.py --lora-rank R`` without an engine: vLLM's max_lora_rank choice and what is
refused before one starts (the run itself: the command in docs/lora.md; the same checks run in
tests/engines/test_vllm_lora.py)."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

from fastsync.errors import ConfigError

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "vllm_sync.py"


def test_engine_max_lora_rank_is_the_smallest_vllm_takes():
    from fastsync.demo.lora_run import engine_max_lora_rank

    assert [engine_max_lora_rank(r) for r in (1, 2, 8, 12, 16, 33, 512)] == [1, 8, 8, 16, 16, 64, 512]
    for bad in (0, -1, 513):
        with pytest.raises(ConfigError, match="--lora-rank"):
            engine_max_lora_rank(bad)


def test_lora_with_a_vllm_reference_is_refused_by_name(capsys, tmp_path):
    spec = importlib.util.spec_from_file_location("vllm_sync_example", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--model", str(tmp_path), "--lora-rank", "8", "--reference", "vllm"]) == 2
    assert "--reference vllm: not with --lora-rank" in capsys.readouterr().err
    assert mod.main(["--model", str(tmp_path), "--lora-rank", "0"]) == 2
    assert "--lora-rank 0" in capsys.readouterr().err
