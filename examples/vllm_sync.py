"""Sync any local HF checkpoint into a live vLLM engine with fastsync and check the result.

    python examples/vllm_sync.py --model HF_DIR [--trainers T] [--tp N] [--dtype float32|bfloat16]

Starts a vLLM engine (CPU build here) with the fastsync worker extension on HF_DIR, starts T
trainer processes that load the same checkpoint, shard it with FSDP2 over gloo and take one
training step, then sync the new weights into the engine (every trainer rank writes its own
shards, NIXL). Prints ``match: true`` when the engine's greedy tokens after the sync equal the
trainer model's own greedy tokens on the new weights (and differ from before), and the sync time.
With ``--reference vllm`` the tokens to equal are a fresh vLLM engine's on the trainer's new
weights saved as a checkpoint (for models whose transformers and vLLM code disagree).
Supported architectures: those with a fastsync name map (``fastsync plugins`` lists them).
"""

from __future__ import annotations

import argparse
import statistics
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="local HF checkpoint directory (config.json + safetensors)")
    p.add_argument("--trainers", type=int, default=2, help="trainer processes holding FSDP2 shards")
    p.add_argument("--tp", type=int, default=1, help="engine tensor_parallel_size")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="engine dtype")
    p.add_argument("--transport", default="nixl")
    p.add_argument("--repeats", type=int, default=3, help="syncs to time (median reported)")
    p.add_argument("--reference", default="hf", choices=["hf", "vllm"],
                   help="check the engine against the trainer's transformers model (hf) or a fresh vLLM engine "
                        "loading the trainer's new weights from disk (vllm)")
    args = p.parse_args(argv)

    from fastsync.demo.run import run_demo, summarize

    rep = run_demo(model_dir=args.model, num_trainers=args.trainers, tp=args.tp, dtype=args.dtype,
                   transport=args.transport, repeats=args.repeats, baseline=False, log=lambda *_: None,
                   reference=args.reference)
    s = summarize(rep)
    ok = s["match"] and s["changed"]
    times = rep["sync_s_max_over_ranks"]["fastsync"]
    print(f"engine start: {rep['engine_start_s']:.1f} s")
    print(f"sync time: {statistics.median(times):.4f} s (median of {len(times)}; " + ", ".join(f"{t:.4f}" for t in times) + ")")
    print(f"engine version: {s['version'][0]} -> {s['version'][1]}")
    print(f"match: {str(ok).lower()}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
