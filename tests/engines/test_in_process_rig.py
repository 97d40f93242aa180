"""``fastsync_rigs.in_process.in_process_vllm``, the rig several engine modules start their TP=1
engines in: a REAL vLLM CPU engine runs in this process and generates, and what vLLM changes in its
process is put back at the end, so the tests that run after it in the same pytest worker see the
process as before. Started after numba is imported (as fastsync's delta encoder does in other modules
of the same worker), which vLLM 0.32's kernel-override scan cannot read without the rig's guard."""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")
pytest.importorskip("numba")

pytestmark = pytest.mark.slow


def test_engine_in_this_process_generates_and_leaves_the_process_as_it_was(tmp_path):
    import numba  # noqa: F401  (before the engine: the case the scan guard is for)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from fastsync.demo.checkpoints import build_tiny_checkpoint
    from fastsync.demo.run import engine_kwargs
    from fastsync_rigs.in_process import in_process_vllm

    ckpt = str(build_tiny_checkpoint("tiny-qwen3", tmp_path / "ckpt"))
    from vllm.v1.worker.cpu_worker import CPUWorker

    environ, threads, set_num_threads = dict(os.environ), torch.get_num_threads(), torch.set_num_threads
    bases = CPUWorker.__bases__
    before = _children()
    with in_process_vllm() as kw:
        llm = LLM(**engine_kwargs(ckpt, 1, "float32"), **kw)
        assert _children() - before == set(), "the engine started processes: not in this process"
        out = llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7])],
                           SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
        assert torch.set_num_threads is not set_num_threads  # vLLM's CPUWorker replaced it here
        assert CPUWorker.__bases__ != bases  # and added fastsync's worker extension to its bases
        llm.llm_engine.engine_core.shutdown()
        del llm
    assert torch.set_num_threads is set_num_threads and torch.get_num_threads() == threads
    assert CPUWorker.__bases__ == bases  # a later engine with another extension passes vLLM's clash check
    assert dict(os.environ) == environ
    from vllm import envs

    assert envs.VLLM_ENABLE_V1_MULTIPROCESSING  # the environment cache an in-process core froze is dropped


def _children() -> set[int]:
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True)}
