"""How OpenMP's wait policy changes a vLLM-CPU engine's decode on this machine: the measurement
in docs/development.md#tests (why the suite's processes are slow on 2 cores).

    for p in ACTIVE PASSIVE; do OMP_WAIT_POLICY=$p .venv/bin/python scripts/omp_wait_probe.py --tp 2; done

Starts a tiny Qwen3 engine (threads unpinned, as the tests run it: ``VLLM_CPU_OMP_THREADS_BIND=nobind``),
warms it with one request, then times 3 rounds of 4 greedy 160-token requests; prints the wall time
and the CPU time of this process and every process under it. Unset, libgomp's default spins like
ACTIVE for a while after each parallel region. A CPU figure: on a GPU engine OpenMP does not run
the model, and a pinned CPU deployment gives each worker its own cores."""

from __future__ import annotations

import argparse
import os
import tempfile
import time


def _cpu_s() -> float:
    import psutil

    total = 0.0
    for p in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        try:
            t = p.cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=2, help="tensor-parallel size (engine workers)")
    ap.add_argument("--tokens", type=int, default=160)
    a = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from fastsync.demo.checkpoints import build_tiny_checkpoint
    from fastsync.demo.run import engine_kwargs

    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(**engine_kwargs(str(build_tiny_checkpoint("tiny-qwen3", tmp)), a.tp, "float32"))
        params = SamplingParams(max_tokens=a.tokens, temperature=0.0, ignore_eos=True)
        llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7])], params, use_tqdm=False)
        cpu0, t0 = _cpu_s(), time.perf_counter()
        for _ in range(3):
            llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7 + i]) for i in range(4)], params, use_tqdm=False)
        wall, cpu = time.perf_counter() - t0, _cpu_s() - cpu0
    print(f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')} tp={a.tp}: 3 rounds of 4 x "
          f"{a.tokens} tokens in {wall:.2f} s wall, {cpu:.2f} s CPU")


if __name__ == "__main__":
    main()
