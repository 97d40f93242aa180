"""``fastsync bench``: spawn trainer and inference processes, sync a synthetic (or preset) model
over each transport, verify, and print seconds per sync, GB/s and the speed-up over rank0."""

from __future__ import annotations

import argparse
import json
import sys

from fastsync.bench.netns_cluster import MAX_HOSTS, MAX_NIC_GBPS
from fastsync.cli._args import float_in, int_in, nonempty, seconds
from fastsync.errors import ConfigError
from fastsync.trace.progress import auto

TRANSPORT_ORDER = ("rank0", "torch", "nixl")
#: Trainer or engine processes one host may run in the benchmark.
MAX_PROCS = 256


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="measure weight-sync transports between real processes on this host")
    p.add_argument("--trainers", type=int_in(1, MAX_PROCS), required=True, help="trainer processes (FSDP shards)")
    p.add_argument("--rollouts", type=int_in(1, MAX_PROCS), required=True, help="engine processes (all replicas together)")
    p.add_argument("--replicas", type=int_in(1, MAX_PROCS), default=1,
                   help="the engine processes form this many identical engines of TP rollouts/replicas (default 1)")
    p.add_argument("--fanout", choices=("chain", "auto", "direct"), default="chain",
                   help="with --replicas: chain (default) = each byte leaves its trainer rank once and engine ranks "
                        "relay it to the next replica; direct = trainers write every replica; auto = the planner's "
                        "cost model. Relays need the nixl transport")
    p.add_argument("--size-gb", type=float_in(0.0, 4096.0), help="synthetic Qwen3-MoE-like model of about this many GB (bf16)")
    p.add_argument("--model", type=nonempty, help="registered model preset (trimmed to --size-gb layers when both are given)")
    p.add_argument("--transport", default="all", help="nixl, torch, rank0, a comma list, or all (default)")
    p.add_argument("--steps", type=int_in(1, 100000), default=5, help="timed syncs per transport (after one warm-up)")
    p.add_argument("--warmup", type=int_in(0, 10000), default=1, help="untimed syncs per transport first")
    p.add_argument("--staging-mb", type=int_in(1, 1 << 20), default=256, help="sender staging budget per trainer rank (MiB)")
    p.add_argument("--mode", choices=("inplace", "shadow"), default="inplace",
                   help="receiver atomicity: in-place writes with a backup refreshed between syncs (default), "
                        "or a shadow copy applied at the flip")
    p.add_argument("--fp8", action="store_true",
                   help="engine holds 128x128 block-FP8 weights plus scales (quantised on the trainers)")
    p.add_argument("--timeout", type=seconds, default=120.0, help="deadline of each sync, seconds")
    p.add_argument("--delta", action="store_true",
                   help="nixl only: a seeded --delta-fraction of the weights changes per version (as an optimizer "
                        "step moves them), and each version after the first is sent as a delta (with --replicas "
                        "and --fanout chain the engine ranks relay the delta streams)")
    p.add_argument("--delta-fraction", type=float_in(0.0, 1.0, lo_open=True), default=0.01,
                   help="with --delta: the fraction of each shard's elements that changes per version (default 0.01)")
    p.add_argument("--check-exact", action="store_true",
                   help="also compare every receiver's tensors with an independent reference (slow, small models)")
    p.add_argument("--verify", choices=("off", "sample", "full"), default="off",
                   help="every engine rank checks each timed sync before its flip, inside the timed sync "
                        "(WeightSync(verify=...)): verify_seconds_median beside seconds_median")
    p.add_argument("--corrupt", type=int_in(1, 100000), default=None, metavar="K",
                   help="fault injection: engine rank 0 flips one byte it received after the writes of each "
                        "transport's K-th timed sync landed (with --verify the version must be refused and rolled back)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--progress", choices=("auto", "on", "off"), default="auto",
                   help="progress on stderr (auto: when stderr is a terminal and not --json)")
    p.add_argument("--trace", metavar="FILE.json", default=None,
                   help="write every process's measured phases as Chrome trace-event JSON (ui.perfetto.dev)")
    p.add_argument("--plot", metavar="FILE.png", default=None,
                   help="write a timeline figure of the measured phases (.png, .svg or .pdf)")
    p.add_argument("--hosts", type=_hosts_arg, default=None, metavar="T:E",
                   help="run on a cluster made on this machine: trainer ranks spread over T hosts, engine ranks over "
                        "E more, each host a network namespace with one NIC of --nic-gbps (needs root / "
                        "CAP_NET_ADMIN); adds measured NIC bytes and the simulator's prediction for that cluster")
    p.add_argument("--nic-gbps", type=float_in(0.0, MAX_NIC_GBPS), default=2.0,
                   help="with --hosts: each host's NIC rate in Gb/s, both directions (default 2)")
    p.add_argument("--latency-ms", type=float_in(0.0, 10000.0, lo_open=False), default=0.0,
                   help="with --hosts: one-way latency added on each host's NIC (needs the netem qdisc)")
    p.set_defaults(func=run)


def _hosts_arg(text: str) -> tuple[int, int]:
    parts = text.split(":")
    if len(parts) != 2 or not all(x.strip().isdigit() for x in parts):
        raise argparse.ArgumentTypeError(f"expected T:E (trainer hosts:engine hosts), e.g. 2:2, got {text!r}")
    t, e = int(parts[0]), int(parts[1])
    if not (1 <= t and 1 <= e and t + e <= MAX_HOSTS):
        raise argparse.ArgumentTypeError(f"T and E must be at least 1 and T + E at most {MAX_HOSTS}, got {text!r}")
    return t, e


def _transports(spec: str) -> list[str]:
    from fastsync import plugins

    names = list(TRANSPORT_ORDER) if spec.strip() == "all" else [s.strip() for s in spec.split(",") if s.strip()]
    regs = plugins.transports()
    if not names:
        raise ConfigError(f"--transport {spec!r} names no transport; give nixl, torch, rank0, a comma list, "
                          f"or all (registered: {sorted(regs)})")
    if len(set(names)) != len(names):
        raise ConfigError(f"--transport {spec!r} names a transport twice")
    for n in names:
        if n not in regs:
            raise ConfigError(f"--transport: unknown transport {n!r}; registered: {sorted(regs)}")
    if spec.strip() == "all":
        names = [n for n in names if regs[n].extra.get("available", True)]
        if not names:
            raise ConfigError("--transport all: no registered transport can run here")
    else:
        for n in names:
            if not regs[n].extra.get("available", True):
                raise ConfigError(f"--transport {n}: cannot run here: {regs[n].extra.get('why', '')}")
    return sorted(names, key=lambda n: TRANSPORT_ORDER.index(n) if n in TRANSPORT_ORDER else len(TRANSPORT_ORDER))


def _fanout_transports(names: list[str], args: argparse.Namespace) -> list[str]:
    """Transports that can run a plan with replicas planned once (and relays, unless direct): with
    ``--transport all`` the others are left out with a note; named explicitly, they are refused."""
    from fastsync import plugins

    def ok(n: str) -> bool:
        extra = plugins.transports()[n].extra
        return bool(extra.get("fanout", False)) and (args.fanout == "direct" or bool(extra.get("relays", False)))

    bad = [n for n in names if not ok(n)]
    if bad and args.transport != "all":
        raise ConfigError(f"--transport {','.join(bad)} cannot run --replicas {args.replicas} with --fanout "
                          f"{args.fanout} (relays between engine ranks need nixl; rank0 runs flat plans only)")
    if bad:
        print(f"note: leaving out {', '.join(bad)}: cannot run --fanout {args.fanout}", file=sys.stderr)
    return [n for n in names if ok(n)]


def run(args: argparse.Namespace) -> int:
    from fastsync.bench.harness import bench_ok, run_bench
    from fastsync.bench.workers import WorkerConfig

    if args.trainers < 1 or args.rollouts < 1:
        raise ConfigError("--trainers and --rollouts must be at least 1")
    if args.size_gb is None and args.model is None:
        raise ConfigError("give --size-gb S or --model PRESET")
    if args.size_gb is not None and args.size_gb <= 0:
        raise ConfigError(f"--size-gb must be positive, got {args.size_gb}")
    if args.steps < 1 or args.warmup < 0:
        raise ConfigError("--steps must be >= 1 and --warmup >= 0")
    if args.replicas < 1 or args.rollouts % args.replicas:
        raise ConfigError(f"--replicas {args.replicas} must be positive and divide --rollouts {args.rollouts}")
    transports = _transports(args.transport)
    from fastsync.cli.plan_outputs import check_arguments

    check_arguments(args)
    if args.replicas > 1:
        transports = _fanout_transports(transports, args)
    if args.corrupt is not None and args.delta:
        raise ConfigError("--corrupt flips a byte of a dense sync's writes; it does not run with --delta")
    if args.delta and transports != ["nixl"]:
        raise ConfigError(f"--delta sends deltas over NIXL only; give --transport nixl (got {args.transport!r})")
    cfg = WorkerConfig(
        trainers=args.trainers, rollouts=args.rollouts, port=0,
        size_bytes=int(args.size_gb * (1 << 30)) if args.size_gb is not None else None, preset=args.model,
        staging_bytes=args.staging_mb << 20, timeout_s=args.timeout, mode=args.mode, check_exact=args.check_exact,
        fp8=args.fp8, trace=bool(args.trace or args.plot), replicas=args.replicas, fanout=args.fanout,
        delta=args.delta, delta_fraction=args.delta_fraction, verify_mode=args.verify, corrupt=args.corrupt,
    )
    progress = auto(json=args.json, force=None if args.progress == "auto" else args.progress == "on")
    if args.hosts is not None:
        result = _run_on_hosts(args, cfg, transports, progress)
    else:
        if args.latency_ms:
            raise ConfigError("--latency-ms needs --hosts (latency is added on the hosts' NICs)")
        result = run_bench(cfg, transports, steps=args.steps, warmup=args.warmup, progress=progress,
                           trace_file=args.trace, plot_file=args.plot)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_table(result)
    return 0 if bench_ok(result) else 1


def _run_on_hosts(args: argparse.Namespace, cfg, transports: list[str], progress: bool) -> dict:
    """The benchmark on a rig of ``--hosts`` network-namespace hosts; every check before the rig
    is built, the rig removed afterwards whatever happens."""
    from fastsync.bench.cluster import calibrate, predict
    from fastsync.bench.harness import run_bench
    from fastsync.bench.netns import rig_unavailable
    from fastsync.bench.netns_cluster import NO_DELAY_QDISC, HostRig, check_shape, netem_available
    from fastsync.plan.shared_nic import HostMap

    t_hosts, e_hosts = args.hosts
    hosts = HostMap.spread(args.trainers, args.rollouts, t_hosts, e_hosts)
    check_shape(hosts.num_hosts, args.nic_gbps, args.latency_ms)
    why = rig_unavailable()
    if why is not None:
        raise ConfigError(f"--hosts: {why}")
    if args.latency_ms and not netem_available():
        raise ConfigError(f"--latency-ms needs the 'netem' qdisc (sch_netem), {NO_DELAY_QDISC}; use --latency-ms 0")
    import os

    load_start = [round(x, 2) for x in os.getloadavg()]  # every host shares this machine's cores: say how busy
    with HostRig(hosts.num_hosts, args.nic_gbps, args.latency_ms) as rig:
        pairs = [(a, b) for a in hosts.trainer_host for b in hosts.engine_host if a != b]  # one per connection
        cal = calibrate(rig, pairs, packers=args.trainers)
        result = run_bench(cfg, transports, steps=args.steps, warmup=args.warmup, progress=progress,
                           trace_file=args.trace, plot_file=args.plot, rig=rig, placement=hosts.placement())
    from fastsync.bench.model import build_bench_model

    model = build_bench_model(trainers=cfg.trainers, rollouts=cfg.rollouts, size_bytes=cfg.size_bytes,
                              preset=cfg.preset, fp8=cfg.fp8, replicas=cfg.replicas, fanout=cfg.fanout)
    # the simulator models dense payloads: a delta's bytes depend on what changed, so --delta is measured only
    preds = {} if cfg.delta else predict(model, hosts, transports, nic_gbps=args.nic_gbps, latency_ms=args.latency_ms,
                                         cal=cal, rank0_bucket_bytes=cfg.rank0_bucket_bytes,
                                         staging_bytes=cfg.staging_bytes)
    for name, r in result["transports"].items():
        p = preds.get(name, {})
        r["predicted_seconds"] = p.get("predicted_seconds")
        r["planned_cross_host_bytes"] = p.get("cross_host_bytes")
        r["prediction"] = p
        med = r.get("seconds_median")
        r["prediction_error"] = (med / p["predicted_seconds"] - 1) if med and p.get("predicted_seconds") else None
    base = preds.get("rank0", {}).get("predicted_seconds")
    result["predicted_speedup_vs_rank0"] = {n: base / p["predicted_seconds"] for n, p in preds.items()
                                            if n != "rank0" and base and p.get("predicted_seconds")}
    result["hosts"] = {"trainer_hosts": t_hosts, "engine_hosts": e_hosts,
                       "trainer_host_of_rank": list(hosts.trainer_host), "engine_host_of_rank": list(hosts.engine_host)}
    result["nic_gbps"], result["latency_ms"], result["calibration"] = args.nic_gbps, args.latency_ms, cal
    result["load_average"] = {"start": load_start, "end": [round(x, 2) for x in os.getloadavg()]}
    return result


def print_table(result: dict, out=None) -> None:
    out = out if out is not None else sys.stdout  # read at call time: a default bound at import outlives a replaced stdout
    gb = result["bytes_per_sync"] / 1e9
    print(f"{result['model']}: {gb:.2f} GB per sync, {result['num_transfers']} planned transfers, "
          f"{result['trainers']} trainer -> {result['rollouts']} inference processes", file=out)
    base = (result["transports"].get("rank0") or {}).get("seconds_median")
    print(f"{'transport':10} {'s/sync (median)':>16} {'GB/s':>7} {'vs rank0':>9} {'failed':>7} {'verified':>9}  "
          "stages (median s; trainer | engine)", file=out)
    for name, r in result["transports"].items():
        med = r["seconds_median"]
        sp = f"{base / med:.1f}x" if base and med else "-"
        st = ", ".join(f"{k} {v:.3f}" for k, v in r["stages_trainer"].items() if v >= 0.0005)
        se = ", ".join(f"{k} {v:.3f}" for k, v in r["stages_engine"].items() if v >= 0.0005)
        ver = r["verified_syncs"] + ("" if r["checksum_verified"] else " NO")
        if r.get("exact") is not None:
            ver += "+exact" if r["exact"] else " EXACT-FAIL"
        med_s = f"{med:.3f}" if med is not None else "failed"
        gbps = f"{r['gbps']:.2f}" if r["gbps"] else "-"
        failed = f"{r['failed_syncs']}/{r['timed_syncs']}"
        print(f"{name:10} {med_s:>16} {gbps:>7} {sp:>9} {failed:>7} {ver:>9}  {st} | {se}", file=out)
        if r["failed_syncs"]:
            print(f"{'':10} FAILED: {r['failed_syncs']} of {r['timed_syncs']} timed syncs (the median is of the "
                  f"other {r['timed_syncs'] - r['failed_syncs']})", file=out)
        if r.get("verify_mode", "off") != "off":
            vs = r.get("verify_seconds_median")
            share = f" ({vs / med:.1%} of the sync)" if vs is not None and med else ""
            print(f"{'':10} verify={r['verify_mode']} before every flip: "
                  f"{f'{vs:.4f} s median' if vs is not None else 'no check completed'}{share}", file=out)
        for c in r.get("corrupted", []):
            print(f"{'':10} --corrupt flipped byte {c['byte']} of {c['tensor']!r} on engine rank {c['engine_rank']}",
                  file=out)
        for e in r["errors"][:3]:
            print(f"{'':10} error: {e}", file=out)
    print("(failed: timed syncs that failed; verified: timed syncs whose every engine rank held exactly the "
          "reference after the clock stopped, NO when the extra checksum-verified sync failed)", file=out)
    if result.get("fault_injected"):
        print(f"test-only fault hook set: {result['fault_injected']['env']}", file=out)
    print("(prepare_between_syncs: in-place backup refresh, done between syncs while trainers train)", file=out)
    if result.get("hosts"):
        h = result["hosts"]
        print(f"cluster: {h['trainer_hosts']} trainer host(s), {h['engine_hosts']} engine host(s), NIC "
              f"{result['nic_gbps']:g} Gb/s (the sync's TCP connections measured {result['calibration']['efficiency']:.2f} of it together)",
              file=out)
        print(f"{'transport':10} {'measured s':>11} {'predicted s':>12} {'error':>7} {'NIC MB/sync':>12} "
              f"{'planned MB':>11}", file=out)
        for name, r in result["transports"].items():
            def f(x, fmt):  # noqa: E306
                return format(x, fmt) if x is not None else "-"
            print(f"{name:10} {f(r['seconds_median'], '11.3f')} {f(r.get('predicted_seconds'), '12.3f')} "
                  f"{f(r['prediction_error'] * 100 if r.get('prediction_error') is not None else None, '+6.1f')}% "
                  f"{f(r.get('nic_bytes', 0) / 1e6 if r.get('nic_bytes') is not None else None, '12.1f')} "
                  f"{f(r['planned_cross_host_bytes'] / 1e6 if r.get('planned_cross_host_bytes') else None, '11.1f')}",
                  file=out)
    for key, what in (("trace_file", "trace"), ("plot_file", "figure")):
        if result.get(key):
            print(f"{what}: {result[key]}", file=out)
    failure = result.get("error")
    if failure:
        print(f"FAILED after versions {result['completed_versions']} completed: {failure['error']}", file=out)
        for e in failure["worker_errors"][:4]:
            print(f"  {e}", file=out)
