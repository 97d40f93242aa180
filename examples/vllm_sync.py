"""Sync any local HF checkpoint into a live vLLM engine with fastsync and check the result.

    python examples/vllm_sync.py --model HF_DIR [--trainers T] [--tp N] [--dtype float32|bfloat16]
                                 [--verify off|sample|full] [--json]

Starts a vLLM engine (CPU build here) with the fastsync worker extension on HF_DIR, starts T
trainer processes that load the same checkpoint, shard it with FSDP2 over gloo and take one
training step, then sync the new weights into the engine (every trainer rank writes its own
shards, NIXL). Prints ``match: true`` when the engine's greedy tokens after the sync equal the
trainer model's own greedy tokens on the new weights (and differ from before), and the sync time.
With ``--reference vllm`` the tokens to equal are a fresh vLLM engine's on the trainer's new
weights saved as a checkpoint (for models whose transformers and vLLM code disagree).
Any architecture vLLM loads: fastsync records where each trainer tensor lands from vLLM's own
loader; ``--json`` says whether every tensor went in place (``inplace``) and which went through
vLLM's ``load_weights`` instead and why (``fallback``). ``--verify full`` (the default here) has
the engine check a CRC of every byte it received against the trainers' before each flip.
``--quantization fp8`` (an FP8 engine fed by BF16 trainers) is refused by name: see ``--help``.

LoRA (``--lora-rank R``, ``fastsync.demo.lora_run``): the engine starts with ``enable_lora=True``; one
trainer process wraps the checkpoint in a PEFT model (LoRA on q/k/v/o and gate/up/down), sends the
base weights once (dense, ``--verify``), then syncs ``--repeats`` adapter versions (new random
matrices each) into the engine's LoRA slots. ``--json`` has ``match`` (the engine's greedy tokens
with each version equal the PEFT model's), ``bytes_equal`` per version (the slot equals what vLLM's
own ``add_lora`` of that version saved to disk loads) and the bytes sent for the base and per
version; exit 1 on any mismatch.
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
    p.add_argument("--verify", default="full", choices=["off", "sample", "full"],
                   help="WeightSync(verify=...): the engine checks the trainers' digests of every byte (full) or "
                        "of a seeded sample before each flip")
    p.add_argument("--quantization", default=None, choices=["fp8"],
                   help="an FP8 engine fed by BF16 trainers: not run live yet (vLLM-CPU's block-FP8 kernels need "
                        "Intel AMX, and fastsync's live FP8 writes are planned and benchmarked, not yet run)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--lora-rank", type=int, default=None,
                   help="LoRA: sync adapter versions of this rank (PEFT, q/k/v/o + gate/up/down) into the engine's "
                        "LoRA slots instead of full weights; the base is sent once (one trainer process)")
    p.add_argument("--lora-alpha", type=float, default=16.0, help="LoRA alpha (scaling alpha / rank), with --lora-rank")
    p.add_argument("--no-base", action="store_true", help="with --lora-rank: do not send the base weights first")
    args = p.parse_args(argv)
    if args.quantization == "fp8":
        from fastsync.engines.vllm.mla import host_has_amx

        why = ("this CPU has no AMX tiles, which vLLM-CPU's block-FP8 kernels need" if not host_has_amx() else
               "live FP8 syncs into vLLM-CPU are not built yet (issue 37 part 3)")
        print(f"--quantization fp8: refused: {why}; `fastsync plan --rollout vllm:tp2,quant=fp8` and "
              "`fastsync bench` model the FP8 sender-side quantization", file=sys.stderr)
        return 2

    import json

    if args.lora_rank is not None:
        return _lora(args)

    from fastsync.demo.run import run_demo, summarize

    from fastsync import ConfigError

    try:
        rep = run_demo(model_dir=args.model, num_trainers=args.trainers, tp=args.tp, dtype=args.dtype,
                       transport=args.transport, repeats=args.repeats, baseline=False, log=lambda *_: None,
                       reference=args.reference, verify=args.verify)
    except ConfigError as e:  # bad input, said before an engine starts
        print(json.dumps({"ok": False, "error": str(e)}) if args.json else f"error: {e}", file=sys.stderr)
        return 2
    if not rep.get("ok", True) and "after_engine" not in rep:
        print(json.dumps({"ok": False, "error": rep.get("error")}) if args.json else f"error: {rep.get('error')}")
        return 1
    s = summarize(rep)
    ok = s["match"] and s["changed"]
    times = rep["sync_s_max_over_ranks"]["fastsync"]
    if args.json:
        fb = s.get("fallback") or {}
        print(json.dumps({"match": ok, "changed": s["changed"], "tokens_equal": s["tokens_equal"],
                          "inplace": fb.get("tensors", 0) == 0, "fallback": fb, "verify": s["verify"],
                          "sync_s_median": statistics.median(times), "sync_s_all": times,
                          "engine_start_s": rep["engine_start_s"], "version": s["version"],
                          "reference": args.reference, "model": args.model, "tp": args.tp,
                          "trainers": args.trainers}))
        return 0 if ok else 1
    print(f"engine start: {rep['engine_start_s']:.1f} s")
    print(f"sync time: {statistics.median(times):.4f} s (median of {len(times)}; " + ", ".join(f"{t:.4f}" for t in times) + ")")
    print(f"engine version: {s['version'][0]} -> {s['version'][1]}")
    print(f"match: {str(ok).lower()}")
    return 0 if ok else 1


def _lora(args: argparse.Namespace) -> int:
    """``--lora-rank R``: fastsync.demo.lora_run; exit 0 only when every version matched in tokens and bytes."""
    import json

    from fastsync.demo.lora_run import engine_max_lora_rank, run_lora_demo
    from fastsync.errors import ConfigError

    try:
        engine_max_lora_rank(args.lora_rank)
    except ConfigError as e:
        print(str(e), file=sys.stderr)
        return 2
    if args.reference != "hf":
        print("--reference vllm: not with --lora-rank (the adapter's tokens are checked against the PEFT model, its "
              "bytes against vLLM's own add_lora)", file=sys.stderr)
        return 2
    out = None
    if args.json:  # stdout carries the JSON alone: vLLM's, NIXL's and the engine processes' logs go to stderr
        import os

        sys.stdout.flush()
        out = os.fdopen(os.dup(1), "w")
        os.dup2(2, 1)
    rep = run_lora_demo(model_dir=args.model, rank=args.lora_rank, alpha=args.lora_alpha, tp=args.tp,
                        dtype=args.dtype, repeats=args.repeats, transport=args.transport, base=not args.no_base,
                        verify=args.verify, log=(lambda *_: None) if args.json else print)
    ok = rep["ok"] and rep["match"] and rep["bytes_equal"]
    if out is not None:
        out.write(json.dumps(rep) + "\n")
        out.flush()
        return 0 if ok else 1
    if not rep["ok"]:
        print(f"error: {rep.get('error')}")
    print(f"adapter: rank {rep['lora_rank']}, {rep.get('bytes_per_version', 0)} B sent per version "
          f"(base: {rep['base'].get('bytes', 0)} B sent once)")
    if "sync_s_median" in rep:
        print(f"adapter sync: {rep['sync_s_median'] * 1e3:.1f} ms median of {len(rep['versions'])} "
              f"(save_pretrained + add_lora: {rep['save_and_add_lora_s_median'] * 1e3:.1f} ms)")
    print(f"bytes_equal: {str(rep['bytes_equal']).lower()}")
    print(f"match: {str(rep['match']).lower()}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
