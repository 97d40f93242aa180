"""``fastsync moe-bench``: HF eager vs HF grouped_mm vs fastsync on one MoE block (fwd+bwd)."""

from __future__ import annotations

import argparse
import json

from fastsync.cli._args import int_in, nonempty, seconds


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "moe-bench",
        help="forward+backward tokens/s, peak memory and error of a MoE block: HF eager, HF grouped_mm, fastsync",
    )
    p.add_argument("--model", required=True, type=nonempty, help="preset name (e.g. qwen3-30b-a3b) or an HF config dir")
    p.add_argument("--tokens", type=int_in(1, 1 << 20), default=2048, help="tokens per step (split over --ep ranks)")
    p.add_argument("--ep", type=int_in(1, 64), default=1, help="expert-parallel processes for fastsync (gloo on CPU)")
    p.add_argument("--reps", type=int_in(1, 1000), default=3, help="timed steps per variant (median reported)")
    p.add_argument("--backend", default="auto", type=nonempty, help="fastsync backend: auto, torch, grouped_mm, te, deepep")
    p.add_argument("--rounds", type=int_in(1, 100), default=2,
                   help="alternating rounds of HF grouped_mm and fastsync (fresh processes; best reported)")
    p.add_argument("--seed", type=int_in(0, 2**63 - 1), default=0)
    p.add_argument("--threads", type=int_in(1, 4096), default=None, help="torch threads per variant (default: all cores; "
                   "split over the --ep processes)")
    p.add_argument("--timeout", type=seconds, default=900.0, help="seconds allowed per variant")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def _mib(n: int) -> str:
    return f"{n / 2**20:8.1f}"


def run(args: argparse.Namespace) -> int:
    from fastsync.bench.moe import run_bench
    report = run_bench(args.model, tokens=args.tokens, ep=args.ep, reps=args.reps, backend=args.backend,
                       seed=args.seed, timeout_s=args.timeout, threads=args.threads, rounds=args.rounds)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"moe-bench {report['model']} ({report['model_type']}): {report['what']}, {report['tokens']} tokens, "
          f"median of {report['reps']} steps, best of {report['rounds']} alternating rounds")
    print(f"{'variant':16} {'tokens/s':>10} {'step s':>8} {'cpu s':>7} {'peak MiB':>9} {'expert MiB/rank':>16} "
          f"{'max abs err':>12}")
    rows = [*report["baselines"].items(), (f"fastsync ep={report['fastsync']['ep']}", report["fastsync"])]
    for name, r in rows:
        print(f"{name:16} {r['tokens_per_s']:10.0f} {r['step_s']:8.3f} {r['cpu_s_per_step']:7.2f} "
              f"{_mib(r['peak_mem_bytes']):>9} "
              f"{_mib(r['expert_param_bytes_per_rank']):>16} {r['max_abs_err']:12.2e}")
    print(f"fastsync vs HF eager: {report['speedup_vs_hf_eager']:.2f}x, vs HF grouped_mm: "
          f"{report['speedup_vs_hf_grouped_mm']:.2f}x")
    print(f"threads per variant: {report['threads']}; 1-min load average before/after: "
          f"{report['load_avg_1min'][0]:.1f}/{report['load_avg_1min'][1]:.1f} (shared machine: wall times are noisy)")
    print(f"peak memory: {report['peak_mem_method']}")
    return 0
