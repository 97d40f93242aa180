"""``fastsync delta-bench``: changed fraction, bytes and seconds of delta vs dense syncs after real
optimizer steps (see ``fastsync.bench.delta``)."""

from __future__ import annotations

import argparse
import json

from fastsync.bench.netns_cluster import MAX_NIC_GBPS
from fastsync.cli._args import float_in, int_in


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("delta-bench", help="real AdamW steps on a small model, then delta vs dense syncs over NIXL: "
                                           "changed fraction, bytes, seconds, verified bit-exact")
    p.add_argument("--model", required=True, help="preset (qwen3-0.6b, qwen3-8b: scaled down) or an HF config dir")
    p.add_argument("--steps", type=int, required=True, help="optimizer steps (each followed by a delta and a dense sync)")
    p.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate (RL-like: 1e-6)")
    p.add_argument("--rollouts", type=int, default=2, help="engine ranks (one TP engine)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int_in(1, 4096), default=1,
                   help="torch threads per process, for both the dense cast and the delta scan (default 1)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed for the whole run")
    p.add_argument("--hosts", type=int_in(2, 2), default=None,
                   help="2: the trainer and the engine ranks on two network-namespace hosts joined by NICs of "
                        "--nic-gbps (needs root / CAP_NET_ADMIN), so the dense sync pays a wire slower than the scan")
    p.add_argument("--nic-gbps", type=float_in(0.0, MAX_NIC_GBPS), default=0.4,
                   help="with --hosts: NIC rate in Gb/s (default 0.4)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from fastsync.bench.delta import DeltaBenchConfig, run_delta_bench

    if args.hosts:
        from fastsync.bench.netns import rig_unavailable
        from fastsync.errors import ConfigError

        why = rig_unavailable()
        if why is not None:
            raise ConfigError(f"--hosts: {why}")
    cfg = DeltaBenchConfig(model=args.model, steps=args.steps, lr=args.lr, rollouts=args.rollouts, batch=args.batch,
                           seq=args.seq, seed=args.seed, threads=args.threads, hosts=args.hosts or 0,
                           nic_gbps=args.nic_gbps)
    rep = run_delta_bench(cfg, timeout_s=args.timeout)
    if args.json:
        print(json.dumps(rep, indent=2))
        return 0 if rep["summary"]["verified"] else 1
    c = rep["config"]
    print(f"delta-bench {rep['model']} (scaled: {c['num_hidden_layers']} layers, hidden {c['hidden_size']}, "
          f"vocab {c['vocab_size']}; {rep['params'] / 1e6:.1f}M params), AdamW lr {rep['lr']:g}, "
          f"{rep['rollouts']} engine ranks, NIXL" + (f", across 2 hosts at {rep['nic_gbps']:g} Gb/s" if rep.get("hosts") else ""))
    print(f"{'step':>4} {'loss':>7} {'changed':>8} {'dense MB':>9} {'delta MB':>9} {'dense s':>8} {'delta s':>8} verified")
    for s in rep["steps"]:
        print(f"{s['step']:>4} {s['loss']:>7.3f} {100 * s['changed_fraction']:>7.3f}% {s['bytes_dense'] / 1e6:>9.2f} "
              f"{s['bytes_delta'] / 1e6:>9.3f} {s['seconds_dense']:>8.4f} {s['seconds_delta']:>8.4f} {s['verified']}")
    sm = rep["summary"]
    print(f"summary: bytes ratio {sm['bytes_ratio']:.4f}, seconds ratio (medians) {sm['seconds_ratio']:.3f}, "
          f"mean changed {100 * sm['changed_fraction']:.3f}%, verified {sm['verified']}")
    return 0 if sm["verified"] else 1
