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
    g = p.add_argument_group("--serve: generation during updates, through a real `vllm serve` (pause modes, staged)")
    g.add_argument("--serve", action="store_true",
                   help="fastsync only, into a `vllm serve` with requests in flight: per update the transfer, "
                        "engine_stall_seconds and the requests by outcome, per pause mode, staged and not")
    g.add_argument("--pause-modes", default="keep,wait,abort", help="vLLM's pause modes to run (default: all three)")
    g.add_argument("--staged", choices=("both", "on", "off"), default="both",
                   help="staged receive on, off, or both for comparison (default both)")
    g.add_argument("--syncs", type=int, default=3, help="timed updates per configuration, after one warm-up")
    g.add_argument("--in-flight", type=int, default=2, help="long requests running when each update starts")
    g.add_argument("--max-tokens", type=int, default=200, help="tokens per request in flight (<= 400)")
    g.add_argument("--tp", type=int, default=1, help="the server's tensor_parallel_size")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import os

    if args.json:  # vLLM logs to stdout by default: keep stdout the JSON
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    import contextlib
    import sys

    from fastsync.bench.weight_transfer import run_weight_transfer_bench

    quiet = contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext()
    if args.serve:
        return _run_serve(args, quiet)
    backends = tuple(b.strip() for b in args.backends.split(",") if b.strip())
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
            runs = "FAILED" if row.get("failed") else "no"
            print(f"{name:18s}{runs:>10s}  {row.get('why', '')[:110]}")
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


def _run_serve(args: argparse.Namespace, quiet) -> int:
    from fastsync.bench.wt_serve_bench import run_serve_bench

    modes = tuple(m.strip() for m in args.pause_modes.split(",") if m.strip())
    staged = {"both": (True, False), "on": (True,), "off": (False,)}[args.staged]
    with quiet:
        r = run_serve_bench(args.model, pause_modes=modes, staged=staged, syncs=args.syncs, in_flight=args.in_flight,
                            max_tokens=args.max_tokens, tp=args.tp, workdir=args.workdir)
    if args.json:
        print(json.dumps(r, indent=2))
        return 0 if r["verified"] else 1
    print(f"weight-transfer-bench --serve {r['model']}: {r['params'] / 1e6:.1f}M parameters, {r['bytes'] / 1e6:.1f} MB "
          f"{r['dtype']}, {r['engine']}, {r['syncs']} updates each with {r['in_flight']} requests of "
          f"{r['max_tokens']} tokens in flight (medians)")
    print(f"{'staged':>7s} {'mode':6s}{'sync s':>9s}{'transfer s':>12s}{'drain s':>9s}{'stall s':>9s}{'flip s':>8s}"
          f"{'stall/sync':>11s}{'on old':>8s}{'across':>8s}{'aborted':>8s}{'verified':>10s}")
    for c in r["configs"]:
        o = c["outcomes"]
        print(f"{'yes' if c['staged'] else 'no':>7s} {c['pause_mode']:6s}{c['sync_median_s']:9.3f}"
              f"{c['transfer_median_s']:12.3f}{c['drain_median_s']:9.3f}{c['stall_median_s']:9.3f}"
              f"{c['worker_update_median_s']:8.3f}"
              f"{c['stall_ratio']:11.2f}{o['finished_on_old']:8d}{o['finished_across']:8d}{o['aborted']:8d}"
              f"{c['rounds_verified']:>10s}")
    print("stall: generation blocked (pause returned to resume returned); drain: vLLM's pause call (wait: the "
          "requests in flight finishing on the old weights); flip: a worker's own time in update_weights (not "
          "staged: the whole receive)")
    return 0 if r["verified"] else 1

