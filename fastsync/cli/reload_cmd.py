"""``fastsync reload-bench``: a new vLLM engine filled from a live peer vs the same engine
loading the same safetensors checkpoint (cold and warm page cache), and time to ready."""

from __future__ import annotations

import argparse
import json


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("reload-bench", help="peer reload vs checkpoint load of a real vLLM CPU engine (weights, ready)")
    p.add_argument("--model", required=True, help="preset (qwen3-400m, qwen3-tiny) or a local HF dir with safetensors")
    p.add_argument("--repeats", type=int, default=3, help="peer reloads and cold/warm checkpoint loads (median)")
    p.add_argument("--workdir", default=None, help="where presets are written (default ~/.cache/fastsync/reload-bench)")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds allowed per reload")
    p.add_argument("--hosts", type=int, default=None, metavar="H",
                   help="K joining engines (--joiners) filled at once from H live holders, each engine on its own "
                        "network-namespace host, against the same engines fetching the checkpoint from a storage host "
                        "over HTTP (needs root / CAP_NET_ADMIN)")
    p.add_argument("--joiners", type=int, default=4, help="with --hosts: engines joining at once (default 4)")
    p.add_argument("--nic-gbps", type=float, default=1.0, help="with --hosts: each host's NIC rate (default 1)")
    p.add_argument("--fanout", default="off", choices=("off", "auto", "chain", "direct"),
                   help="with --hosts: off, each joining engine from one holder (joiner j from holder j %% H); "
                        "auto/chain/direct, every joining engine in one plan, the holders feeding chains of joining "
                        "engines that forward what landed to the next (auto: the planner's cost model picks the "
                        "number of chains)")
    p.add_argument("--chunk-mb", type=float, default=1.0,
                   help="with --fanout other than off: write batches (and transfers) of at most this many MB, "
                        "what a joining engine forwards at once (default 1)")
    p.add_argument("--queue-ms", type=float, default=200.0,
                   help="with --hosts: each NIC's queue depth in ms at line rate (default 200; a real NIC's is a few ms)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import os

    if args.json:  # vLLM logs to stdout by default (engine processes inherit this): keep stdout the JSON
        os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    import contextlib
    import sys

    from fastsync.bench.reload import run_reload_bench

    # with --json, stdout carries only the report: libraries' log lines (NIXL logs to stdout) go to stderr
    quiet = contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext()
    if args.hosts is not None:
        from fastsync.bench.reload_hosts import run_reload_bench_hosts

        with quiet:
            r = run_reload_bench_hosts(args.model, holders=args.hosts, joiners=args.joiners, nic_gbps=args.nic_gbps,
                                       repeats=args.repeats, workdir=args.workdir, timeout_s=args.timeout * 3,
                                       fanout=args.fanout, chunk_bytes=int(args.chunk_mb * (1 << 20)),
                                       queue_ms=args.queue_ms)
        if args.json:
            print(json.dumps(r, indent=2))
        else:
            w = r["weights_seconds"]
            print(f"reload-bench {r['model']}: {r['checkpoint_bytes'] / 1e6:.0f} MB checkpoint, {r['joiners']} engines "
                  f"joining at once, {r['holders']} live holders, NICs {r['nic_gbps']:g} Gb/s, fanout {r['fanout']} "
                  f"{r.get('chains', '')}, {r['engine']}")
            print(f"weights: peer {w['peer']:.2f} s, checkpoint from the storage host {w['checkpoint']:.2f} s: "
                  f"{r['speedup_weights']:.2f}x; ready: {r['speedup_ready']:.2f}x; verified {r['verified']}")
        return 0 if r["verified"] else 1
    with quiet:
        r = run_reload_bench(args.model, repeats=args.repeats, workdir=args.workdir, timeout_s=args.timeout)
    if args.json:
        print(json.dumps(r, indent=2))
        return 0 if r["verified"] else 1
    w, rd = r["weights_seconds"], r["ready_seconds"]
    d, rdd = w["detail"], rd["detail"]
    print(f"reload-bench {r['model']}: {r['checkpoint_bytes'] / 1e6:.0f} MB checkpoint, {r['engine']}")
    print(f"{'':28s}{'peer':>10s}{'ckpt cold':>11s}{'ckpt warm':>11s}")
    print(f"{'weights (s, median)':28s}{w['peer']:10.3f}{d['checkpoint_cold']:11.3f}{d['checkpoint_warm']:11.3f}")
    print(f"{'ready (s)':28s}{rd['peer']:10.2f}{rd['checkpoint']:11.2f}")
    print(f"speed-up weights {r['speedup_weights']:.1f}x cold, {r['speedup_weights_warm']:.1f}x warm; "
          f"ready {r['speedup_ready']:.2f}x")
    pw = d["peer_worker"]
    print(f"peer in the worker: connect+register {pw['connect_s']:.3f} s, begin {pw['begin_s']:.3f} s, wait "
          f"{pw['wait_s']:.3f} s, repack {pw['postprocess_s']:.3f} s, close {pw['close_s']:.3f} s; NIXL registration "
          f"{r['registration_seconds']:.4f} s")
    print(f"ready breakdown: engine start without weights {rdd['engine_start_dummy']:.1f} s, first request "
          f"{rdd['first_request_peer']:.2f} s; engine start with checkpoint {rdd['engine_start_with_checkpoint_cold']:.1f} s")
    print(f"page cache (resident fraction): {r['page_cache']}")
    print(f"verified: {r['verified']} ({r['verified_detail']['how']})")
    return 0 if r["verified"] else 1
