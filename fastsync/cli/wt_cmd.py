"""``fastsync weight-transfer-bench``: one model through vLLM's own weight-transfer API calls
with ``backend="fastsync"`` and with each of vLLM's own backends, verified, side by side."""

from __future__ import annotations

import argparse
import json


def add_parser(sub: argparse._SubParsersAction) -> None:
    from fastsync.bench.weight_transfer import BACKENDS

    p = sub.add_parser("weight-transfer-bench",
                       help="fastsync vs vLLM's own weight-transfer backends through the same vLLM API (CPU engine)")
    p.add_argument("--model", default="small", help="preset (tiny, small) or a local HF dir (default small)")
    p.add_argument("--backends", default=",".join(BACKENDS),
                   help=f"comma-separated, from {','.join(BACKENDS)} (default: all)")
    p.add_argument("--repeats", type=int, default=5, help="timed updates per backend, after one warm-up (median)")
    p.add_argument("--workdir", default=None, help="where presets are written (default ~/.cache/fastsync/wt-bench)")
    p.add_argument("--in-process", action="store_true",
                   help="run each engine inside this process (VLLM_ENABLE_V1_MULTIPROCESSING=0), as vLLM's API tests do")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import os

    if args.json:  # vLLM logs to stdout by default: keep stdout the JSON
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    import contextlib
    import sys

    from fastsync.bench.weight_transfer import run_weight_transfer_bench

    backends = tuple(b.strip() for b in args.backends.split(",") if b.strip())
    quiet = contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext()
    with quiet:
        r = run_weight_transfer_bench(args.model, backends=backends, repeats=args.repeats, workdir=args.workdir,
                                      in_process=args.in_process)
    if args.json:
        print(json.dumps(r, indent=2))
        return 0 if r["verified"] else 1
    print(f"weight-transfer-bench {r['model']}: {r['params'] / 1e6:.1f}M parameters, {r['bytes'] / 1e6:.1f} MB "
          f"{r['dtype']}, {r['engine']}, {r['repeats']} timed updates each (median)")
    print(f"{'backend':18s}{'runs here':>10s}{'init s':>9s}{'update s':>10s}{'min s':>9s}{'GB/s':>8s}"
          f"{'x fastsync':>12s}{'verified':>10s}")
    for name, row in r["backends"].items():
        if not row.get("median_s"):
            print(f"{name:18s}{'no':>10s}  {row.get('why', '')[:110]}")
            continue
        print(f"{name:18s}{'yes':>10s}{row['trainer_init_s']:9.2f}{row['median_s']:10.4f}{row['min_s']:9.4f}"
              f"{row['gbps']:8.2f}{r['ratio_to_fastsync'].get(name, float('nan')):12.2f}"
              f"{row['rounds_verified']:>10s}")
    fs = r["backends"].get("fastsync", {}).get("engine_median_s")
    if fs:
        print("fastsync inside the worker (median s): " + ", ".join(f"{k} {v:.4f}" for k, v in fs.items()))
    print(f"verified: {r['verified']} (greedy tokens equal the trainer's and get_weight_version is the round's, "
          "after every update)")
    return 0 if r["verified"] else 1
