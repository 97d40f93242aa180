"""``fastsync moe-bench``: HF eager vs HF grouped_mm vs fastsync on one MoE block (fwd+bwd)."""

from __future__ import annotations

import argparse
import json
import sys

from fastsync.cli._args import int_in, nonempty, seconds


def _perturb(text: str) -> tuple[str, float]:
    variant, sep, amount = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r}: give VARIANT=RELATIVE_ERROR")
    return variant, float(amount)


#: fastsync.bench.moe.REL_TOL, written out so that building the parser imports no torch
#: (tests/moe/test_moe_cli.py holds the two equal)
DTYPE_TOL = {"float32": 1e-4, "bfloat16": 5e-2}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "moe-bench",
        help="forward+backward tokens/s, peak memory and error of a MoE block: HF eager, HF grouped_mm, fastsync",
    )
    p.add_argument("--model", required=True, type=nonempty, help="preset name (e.g. qwen3-30b-a3b) or an HF config dir")
    p.add_argument("--tokens", type=int_in(1, 1 << 20), default=2048, help="tokens per step (split over --ep ranks)")
    p.add_argument("--ep", type=int_in(1, 64), default=1, help="expert-parallel processes for fastsync (gloo on CPU)")
    p.add_argument("--reps", type=int_in(1, 1000), default=3, help="timed steps per variant and round")
    p.add_argument("--backend", default="auto", type=nonempty, help="fastsync backend: auto, torch, grouped_mm, te, deepep")
    p.add_argument("--rounds", type=int_in(1, 100), default=2,
                   help="rounds of every variant, alternating, each a fresh process (the median is over all "
                        "rounds x reps timed steps, the same for every variant)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPE_TOL),
                   help="parameters and activations; a variant whose max relative error against HF eager exceeds "
                        + ", ".join(f"{t:g} ({d})" for d, t in DTYPE_TOL.items()) + " fails the bench (exit 1)")
    p.add_argument("--seed", type=int_in(0, 2**63 - 1), default=0)
    p.add_argument("--threads", type=int_in(1, 4096), default=None, help="torch threads per variant (default: all cores; "
                   "split over the --ep processes)")
    p.add_argument("--timeout", type=seconds, default=900.0, help="seconds allowed per variant")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    # test-only fault hook: VARIANT=REL adds a relative error REL to that variant's output
    p.add_argument("--test-perturb", type=_perturb, action="append", default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=run)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def _ratio(r: float | None) -> str:
    if r is None:
        return "-"
    return f"{r:.2f} ({(1 - r) * 100:.0f}% less)" if r <= 1 else f"{r:.2f} ({(r - 1) * 100:.0f}% more)"


def run(args: argparse.Namespace) -> int:
    from fastsync.bench.moe import run_bench
    report = run_bench(args.model, tokens=args.tokens, ep=args.ep, reps=args.reps, backend=args.backend,
                       seed=args.seed, timeout_s=args.timeout, threads=args.threads, rounds=args.rounds,
                       dtype=args.dtype, perturb=dict(args.test_perturb or []))
    tol = report["rel_tol"][report["dtype"]]
    for m in report["mismatches"]:
        what = m["error"] or (f"max rel err {m['max_rel_err']:.3g} in {m['worst_tensor']}, "
                              f"{m['times_tolerance']:.3g}x the tolerance")
        print(f"moe-bench: MISMATCH {m['variant']}: {what} (tolerance {tol:g} for {report['dtype']}, "
              "against HF eager)", file=sys.stderr)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0 if report["ok"] else 1
    print(f"moe-bench {report['model']} ({report['model_type']}): {report['what']}, {report['tokens']} tokens, "
          f"{report['statistic']}")
    print(f"{'variant':16} {'tokens/s':>9} {'step s median [min-max]':>24} {'cpu s':>6} {'peak MiB':>9} "
          f"{'vs stock v5':>16} {'expert MiB/rank':>15} {'max rel err':>11}")
    rows = [*report["baselines"].items(), (f"fastsync ep={report['fastsync']['ep']}", report["fastsync"])]
    for name, r in rows:
        steps = f"{r['step_s']:.3f} [{r['step_s_min']:.3f}-{r['step_s_max']:.3f}]"
        err = "-" if r["max_rel_err"] is None else f"{r['max_rel_err']:.1e}"
        print(f"{name:16} {r['tokens_per_s']:9.0f} {steps:>24} {r['cpu_s_per_step']:6.2f} "
              f"{_mib(r['peak_mem_bytes']):>9} {_ratio(r['peak_mem_ratio_vs_stock']):>16} "
              f"{_mib(r['expert_param_bytes_per_rank']):>15} {err:>11}")
    print(f"fastsync vs HF eager: {report['speedup_vs_hf_eager']:.2f}x, vs HF grouped_mm: "
          f"{report['speedup_vs_hf_grouped_mm']:.2f}x (tokens/s, medians)")
    print(f"peak memory: {report['peak_mem_method']}; 'vs stock v5' = over {report['peak_mem_stock']} "
          f"(Transformers v5's default experts kernel)" + (", fastsync per rank" if report["fastsync"]["ep"] > 1 else ""))
    print(f"memory goal: {report['peak_mem_goal']}; measured here on the CPU: fastsync "
          f"{_ratio(report['peak_mem_ratio_vs_hf_grouped_mm'])}")
    print(f"note: {report['peak_mem_note']}")
    print(f"threads per variant: {report['threads']}; 1-min load average before/after: "
          f"{report['load_avg_1min'][0]:.1f}/{report['load_avg_1min'][1]:.1f} (shared machine: wall times are noisy)")
    if report["ok"]:
        print(f"numerics: every variant within max rel err {tol:g} ({report['dtype']}) of HF eager")
        return 0
    print(f"numerics: {len(report['mismatches'])} variant(s) over max rel err {tol:g} ({report['dtype']}) "
          "against HF eager (above): exit 1")
    return 1
