"""``fastsync demo``: trainer processes with FSDP2 shards sync a live vLLM engine (``make demo``).

Builds a tiny random-weight Qwen3-MoE checkpoint (nothing downloaded), starts a vLLM CPU engine
with the fastsync worker extension, starts the trainer processes, takes a training step, syncs
with fastsync (every rank writes its shards, NIXL) and with the rank-0 baseline, and prints the
greedy generations before/after, whether they equal the trainer model's own, and the sync times.
"""

from __future__ import annotations

import argparse
import json

from fastsync.cli._args import int_in, nonempty, seconds
from fastsync.errors import ConfigError
from fastsync.trace.progress import auto


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="end to end: FSDP2 trainers write into a live vLLM engine (fastsync vs rank-0)")
    p.add_argument("--model", default=None, type=nonempty, help="local HF checkpoint directory (default: build a tiny random one)")
    p.add_argument("--preset", default="small-qwen3-moe", type=nonempty, help="random checkpoint to build: small-qwen3-moe | tiny-qwen3-moe | tiny-qwen3")
    p.add_argument("--trainers", type=int_in(1, 8), default=2, help="trainer processes (2-4)")
    p.add_argument("--tp", type=int_in(1, 8), default=1, help="engine tensor_parallel_size")
    p.add_argument("--transport", default="nixl", type=nonempty, help="transport for both paths (nixl)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="engine dtype (float32: engine and trainer agree token for token; bfloat16 can flip "
                        "near-tied greedy choices)")
    p.add_argument("--repeats", type=int_in(1, 1000), default=3, help="syncs per path (the median is reported)")
    p.add_argument("--max-tokens", type=int_in(1, 200), default=8, help="greedy tokens per prompt")
    p.add_argument("--workdir", default=None, help="where the tiny checkpoint is written")
    p.add_argument("--no-baseline", action="store_true", help="skip the rank-0 baseline")
    p.add_argument("--timeout", type=seconds, default=120.0, help="seconds any one step may take")
    p.add_argument("--staged", choices=("on", "off"), default="on",
                   help="on (default): the engine keeps generating while fastsync's writes land, and pauses only "
                        "for the flip; off: it pauses for the whole transfer")
    p.add_argument("--pause-mode", choices=("wait", "abort", "keep"), default="wait",
                   help="what the engine does with requests in flight at each pause (vLLM's modes): wait (default) "
                        "lets them finish on the old version, abort aborts them, keep carries them across the flip")
    p.add_argument("--verify", choices=("off", "sample", "full"), default="off",
                   help="what the engine checks of each fastsync sync before its flip, inside the timed sync "
                        "(WeightSync(verify=...)): off (default), a seeded sample of blocks, or every byte")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from fastsync.demo.baseline import MIRRORS
    from fastsync.demo.run import run_demo, summarize

    if args.repeats < 1:
        raise ConfigError(f"--repeats must be at least 1, got {args.repeats}")
    quiet = args.json
    log = (lambda *_: None) if quiet else print
    rep = run_demo(model_dir=args.model, preset=args.preset, num_trainers=args.trainers, workdir=args.workdir,
                   max_tokens=args.max_tokens, transport=args.transport, baseline=not args.no_baseline,
                   repeats=args.repeats, tp=args.tp, timeout_s=args.timeout, dtype=args.dtype, log=log,
                   progress=auto(json=args.json), staged=args.staged == "on", load=True,
                   pause_mode=args.pause_mode, verify=args.verify)
    s = summarize(rep)
    # one verdict for both outputs: fastsync's result and (when run) the baseline's must match the trainer
    ok = bool(s["match"] and s["changed"] and s.get("baseline_match", True))
    if args.json:
        if "baseline_sync_s" in s:
            s["baseline_mirrors"] = MIRRORS
        print(json.dumps({"summary": {**s, "ok": ok}, "report": rep}, default=str))
        return 0 if ok else 1
    print(f"engine start: {rep['engine_start_s']:.1f} s   fastsync set-up (layouts, plan, memory registration; "
          f"includes waiting for the engine): {rep['setup_s']:.1f} s")
    staged = rep.get("staged", {})
    if staged:
        print(f"staged (cannot be written in place on this engine): {len(staged)} parameters, e.g. "
              f"{next(iter(staged))}: {next(iter(staged.values()))}")
    print("\ngreedy tokens per prompt")
    for i, (b, a, t) in enumerate(zip(rep["before_engine"], rep["after_engine"], rep["after_trainer"])):
        print(f"  prompt {i}: engine before {b}\n            engine after  {a}\n            trainer model {t}")
    print(f"\nengine version: {s['version'][0]} -> {s['version'][1]}")
    print(f"changed by the sync: {str(s['changed']).lower()}   engine == trainer after sync: {str(s['match']).lower()} "
          f"({s['tokens_equal']} tokens equal)")
    if not s["match"] and args.dtype == "bfloat16":
        print("  (bf16: the engine's fused CPU kernels and the HF forward round differently; a near-tied greedy "
              "choice can flip. --dtype float32 compares exactly.)")
    print(f"\n{'path':34} {'sync s (median)':>16}  per repeat")
    fs = rep["sync_s_max_over_ranks"]["fastsync"]
    print(f"{'fastsync (all ranks write, ' + args.transport + ')':34} {s['fastsync_sync_s']:16.4f}  "
          + " ".join(f"{x:.4f}" for x in fs))
    if "engine_stall_seconds" in s:
        print(f"  with a client keeping requests going: {s['loaded_sync_s']:.4f} s per sync, the engine paused "
              f"{s['engine_stall_seconds']:.4f} s of it ({100 * s['stall_share_of_sync']:.0f}%, staged {args.staged}); "
              f"{s['requests_finished_during_syncs']} requests finished during those syncs, {s['requests_aborted']} aborted")
        for y in s.get("syncs", []):
            print(f"    v{y['version']} ({s['pause_mode']}): sync {y['sync_s']:.4f} s, stall {y['engine_stall_seconds']:.4f} s"
                  f", drain {y['drain_s']:.4f} s; in flight at the pause {y['requests_in_flight']}: finished on old "
                  f"{y['finished_on_old']}, across {y['finished_across']}, aborted {y['aborted']}")
    for w in rep.get("engine_side", []):
        print(f"  engine rank {w['rank']} (last fastsync sync): waited {w['wait_s']:.4f} s for the writes, "
              f"repacked CPU kernel weights in {w['postprocess_s']:.4f} s")
    if "baseline_sync_s" in s:
        bs = rep["sync_s_max_over_ranks"]["baseline"]
        print(f"{'rank-0 baseline (gather + 1 sender)':34} {s['baseline_sync_s']:16.4f}  " + " ".join(f"{x:.4f}" for x in bs))
        print(f"  the baseline mirrors {MIRRORS}")
        print(f"speed-up: {s['speedup']:.2f}x   baseline result equals trainer: {str(s['baseline_match']).lower()}")
    print(f"\nmatch: {str(ok).lower()}")
    return 0 if ok else 1
