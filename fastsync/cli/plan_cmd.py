"""``fastsync plan``: plan and simulate one weight sync of a real model between two layouts.

Example::

    fastsync plan --model kimi-k2 --trainer fsdp:256 --rollout vllm:tp8,dp4,ep,replicas4 \\
        --nic-gbps 400 --dtype-out fp8

Builds the inventory and both layouts from their specs, computes the static plan, simulates it
and the rank-0 broadcast baseline, and prints a short table (or one JSON object with ``--json``).
Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import math
import json
import time
from pathlib import Path

from fastsync.cli import plan_outputs
from fastsync.cli._args import float_in, int_in, nonempty
from fastsync.errors import ConfigError
from fastsync.trace.progress import Steps, auto

__all__ = ["add_parser", "run", "plan_report"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="plan and simulate a weight sync between a trainer and an inference layout",
                       description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--model", required=True, type=nonempty, help="preset name (e.g. kimi-k2) or a directory with a HF config.json")
    p.add_argument("--trainer", required=True, type=nonempty, help="trainer layout spec, e.g. fsdp:256, hsdp:2x64, zero3:8")
    p.add_argument("--rollout", required=True, type=nonempty, help="inference layout spec, e.g. vllm:tp8,dp4,ep,replicas4")
    p.add_argument("--nic-gbps", type=float_in(0.001, 1e6, lo_open=False), default=400.0, help="per-GPU NIC bandwidth in Gb/s (default 400)")
    p.add_argument("--intra-node-gbps", type=float_in(0.001, 1e6, lo_open=False), default=None,
                   help="per-GPU intra-node bandwidth in Gb/s for owner gathers (default: NIC speed)")
    p.add_argument("--gpus-per-node", type=int_in(1, 1024), default=8, help="trainer GPUs per node (default 8)")
    p.add_argument("--dtype-out", choices=["bf16", "fp8"], default="bf16", help="engine weight dtype (default bf16)")
    p.add_argument("--max-transfer-mb", type=float_in(0.0, float(1 << 30)), default=None,
                   help="split transfers larger than this many MiB into chunks (default: no split)")
    p.add_argument("--delta-fraction", type=float_in(0.0, 1.0, lo_open=False), default=None, metavar="F",
                   help="also predict a delta sync where fraction F of engine elements changed (measure F with "
                        "fastsync delta-bench)")
    p.add_argument("--fanout", choices=["auto", "direct", "chain", "off"], default="auto",
                   help="identical replicas: plan one and feed the others straight from trainer ranks (direct), "
                        "relayed by engine ranks (chain: each byte leaves its trainer rank once) or as the cost "
                        "model picks per transfer (auto, default); off plans every engine rank")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--save", metavar="PATH", default=None, help="write the serialised plan to PATH")
    plan_outputs.add_arguments(p)
    p.set_defaults(func=run)


def _gb(n: float) -> str:
    for unit, div in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= div:
            return f"{n / div:.2f} {unit}"
    return f"{int(n)} B"


def _secs(s: float) -> str:
    """Seconds with enough digits that a small time never prints as 0.0."""
    if s >= 10:
        return f"{s:.1f} s"
    if s >= 0.001:
        return f"{s:.3f} s"
    return f"{s:.2e} s"


def baseline_ratio(rank0_s: float, fastsync_s: float) -> str:
    """How the rank-0 baseline compares with fastsync, stated the right way round."""
    if rank0_s <= 0 or fastsync_s <= 0:
        return "no ratio: a predicted time is zero"
    if rank0_s >= fastsync_s:
        return f"{rank0_s / fastsync_s:.1f}x slower than fastsync"
    return f"{fastsync_s / rank0_s:.1f}x faster than fastsync"


def plan_report(args: argparse.Namespace) -> dict:
    """Build everything and return the report as a dict (what ``--json`` prints)."""
    with Steps(6, enabled=auto(json=getattr(args, "json", False)), desc="fastsync plan") as steps:
        return _plan_report(args, steps)


def _plan_report(args: argparse.Namespace, steps: Steps) -> dict:
    from fastsync.layout.spec import engine_layout_from_spec, trainer_layout_from_spec
    from fastsync.models import load_inventory
    from fastsync.plan.fingerprint import plan_hash
    from fastsync.plan.planner import build_plan
    from fastsync.plan.simulate import rank0_baseline, simulate

    # the same checks as the argparse types, for callers that build the Namespace themselves
    for flag, value in (("nic_gbps", args.nic_gbps), ("intra_node_gbps", args.intra_node_gbps)):
        if value is not None and not (isinstance(value, (int, float)) and 0.001 <= value <= 1e6 and math.isfinite(value)):
            raise ConfigError(f"--{flag.replace('_', '-')} ({flag}) must be a finite number in [0.001, 1e6] Gb/s, got {value}")
    if not isinstance(args.gpus_per_node, int) or not 1 <= args.gpus_per_node <= 1024:
        raise ConfigError(f"--gpus-per-node must be an integer in 1..1024, got {args.gpus_per_node}")
    max_bytes = None
    if args.max_transfer_mb is not None:
        if not (0 < args.max_transfer_mb <= (1 << 30) and math.isfinite(args.max_transfer_mb)):
            raise ConfigError(f"--max-transfer-mb must be a finite number in (0, 2**30], got {args.max_transfer_mb}")
        max_bytes = int(args.max_transfer_mb * (1 << 20))
        if max_bytes <= 0:
            raise ConfigError(f"--max-transfer-mb {args.max_transfer_mb} is under one byte")
    plan_outputs.check_arguments(args)
    t0, c0 = time.perf_counter(), time.process_time()
    steps.next(f"inventory of {args.model}")
    inv = load_inventory(args.model)
    steps.next("layouts")
    trainer = trainer_layout_from_spec(args.trainer, inv)
    engine = engine_layout_from_spec(args.rollout, inv, dtype_out=args.dtype_out)
    t1 = time.perf_counter()
    # a tied lm_head is the embedding: the engine reads it once, under the embedding's name
    tied = {"lm_head.weight"} if inv.tied_embeddings else set()
    steps.next(f"planning {len(inv.params)} parameters onto {engine.world_size} engine ranks")
    plan = build_plan(inv.params, trainer, engine, max_transfer_bytes=max_bytes, allow_unread=tied,
                      fanout=args.fanout)
    steps.next(f"hashing {len(plan.transfers)} transfers")
    digest = plan_hash(plan)
    t2, c2 = time.perf_counter(), time.process_time()
    steps.next("simulating")
    events: list[dict] | None = [] if getattr(args, "trace", None) else None
    sim = simulate(plan, nic_gbps=args.nic_gbps, intra_node_gbps=args.intra_node_gbps,
                   gpus_per_node=args.gpus_per_node, on_event=None if events is None else events.append)
    base = rank0_baseline(inv.params, engine.world_size, nic_gbps=args.nic_gbps, num_trainers=trainer.world_size,
                          intra_node_gbps=args.intra_node_gbps, gpus_per_node=args.gpus_per_node)
    if args.save:
        Path(args.save).write_text(plan.dumps())
    steps.next("writing the trace / figure")
    files = plan_outputs.write_outputs(args, plan, sim, events, f"{inv.name}: {args.trainer} -> {args.rollout}, "
                                       f"{args.nic_gbps:g} Gb/s per GPU")
    delta = _delta_report(plan, args)
    return {
        "padded": padded_report(plan),
        "model": inv.name,
        "architecture": inv.architecture,
        "trainer": args.trainer,
        "rollout": args.rollout,
        "dtype_out": args.dtype_out,
        "nic_gbps": args.nic_gbps,
        "intra_node_gbps": args.intra_node_gbps,
        "num_trainers": trainer.world_size,
        "num_receivers": engine.world_size,
        "tensors": len(inv.params),
        "engine_tensors": sum(len(ts) for ts in engine.tensors.values()),
        "model_bytes": sum(p.nbytes for p in inv.params.values()),
        "bytes_total": plan.bytes_total,
        "transfers": len(plan.transfers),
        "fanout": args.fanout,
        "replicas": plan.fanout.replicas if plan.fanout else 1,
        "trainer_fed_replicas": sum(1 for p in plan.fanout.parents if p < 0) if plan.fanout else 1,
        "relay_hops": sim.relay_hops,
        "relayed_bytes": sim.relayed_bytes,
        "max_relay_send_bytes": sim.max_relay_send_bytes,
        "relay_seconds": sim.relay_seconds,
        "gathers": len(plan.gathers),
        "gather_owners": len(set(plan.gathers.values())),
        "max_send_bytes": sim.max_send_bytes,
        "mean_send_bytes": sim.mean_send_bytes,
        "max_recv_bytes": sim.max_recv_bytes,
        "mean_recv_bytes": sim.mean_recv_bytes,
        "send_balance": sim.send_balance,
        "recv_balance": sim.recv_balance,
        "predicted_seconds": sim.predicted_seconds,
        "lower_bound_seconds": sim.lower_bound_seconds,
        "direct_bound_seconds": sim.direct_bound_seconds,
        "physical_bound_seconds": sim.physical_bound_seconds,
        "max_owner_unique_bytes": max(plan.meta.get("owner_unique_bytes") or [0]),
        "bottleneck": sim.bottleneck,
        "rank0_predicted_seconds": base.predicted_seconds,
        "rank0_assumption": base.assumption,
        "plan_seconds": t2 - t0,
        "layout_seconds": t1 - t0,
        "planner_seconds": t2 - t1,
        "plan_cpu_seconds": c2 - c0,
        "plan_hash": digest,
        "unread_params": plan.meta["unread_params"],
        "saved_to": args.save,
        **files,
        **({"delta": delta} if delta else {}),
    }


def padded_report(plan: object, examples: int = 4) -> dict:
    """Engine tensors the engine pads, from the plan's records (``Plan.padded``, both shapes per
    planned engine rank): how many, the padding bytes no transfer writes, and a few examples.
    The saved plan (``--save``) holds every record."""
    from fastsync.layout.types import DTYPE_BYTES

    dtypes = {t.dst_tensor: t.nbytes // max(1, math.prod(e - s for s, e in t.dst_box)) for t in plan.transfers}  # type: ignore[attr-defined]
    count, pad_bytes, rows = 0, 0, []
    for rank, ts in sorted(plan.padded.items()):  # type: ignore[attr-defined]
        for name, (logical, engine) in sorted(ts.items()):
            count += 1
            pad_bytes += (math.prod(engine) - math.prod(logical)) * dtypes.get(name, DTYPE_BYTES["bfloat16"])
            if len(rows) < examples:
                rows.append({"rank": rank, "tensor": name, "logical": list(logical), "engine": list(engine)})
    return {"tensors": count, "padding_bytes": pad_bytes, "examples": rows}


def _delta_report(plan: object, args: argparse.Namespace) -> dict | None:
    """The delta sync of ``plan`` at ``--delta-fraction``, priced by the same simulator."""
    f = getattr(args, "delta_fraction", None)
    if f is None:
        return None
    from fastsync.plan.delta_sim import delta_plan
    from fastsync.plan.simulate import simulate

    dplan = delta_plan(plan, f)
    sim = simulate(dplan, nic_gbps=args.nic_gbps, intra_node_gbps=args.intra_node_gbps,
                   gpus_per_node=args.gpus_per_node)
    return {"fraction": f, "bytes_total": dplan.bytes_total, "max_recv_bytes": sim.max_recv_bytes,
            "predicted_seconds": sim.predicted_seconds, "bottleneck": sim.bottleneck}


def run(args: argparse.Namespace) -> int:
    r = plan_report(args)
    if args.json:
        print(json.dumps(r))
        return 0
    over = (r["predicted_seconds"] / r["physical_bound_seconds"] - 1) * 100 if r["physical_bound_seconds"] else 0.0
    fan = ""
    if r["replicas"] > 1:
        fan = (f"; {r['replicas']} replicas planned once, {r['trainer_fed_replicas']} fed by trainers, "
               f"{_gb(r['relayed_bytes'])} relayed ({r['relay_hops']} hops)")
    rows = [
        ("model", f"{r['model']} ({r['architecture']})"),
        ("layouts", f"trainer {r['trainer']} ({r['num_trainers']} ranks) -> rollout {r['rollout']} "
                    f"({r['num_receivers']} ranks), out {r['dtype_out']}"),
        ("tensors", f"{r['tensors']} parameters -> {r['engine_tensors']} engine tensors on all ranks"),
        ("bytes", f"{_gb(r['bytes_total'])} into receivers (model {_gb(r['model_bytes'])} as trained)"),
        ("transfers", f"{r['transfers']} ({r['gathers']} parameters gathered on {r['gather_owners']} owners){fan}"),
        ("send per trainer", f"max {_gb(r['max_send_bytes'])} / mean {_gb(r['mean_send_bytes'])} "
                             f"= {r['send_balance']:.2f}"),
        ("recv per engine rank", f"max {_gb(r['max_recv_bytes'])} / mean {_gb(r['mean_recv_bytes'])} "
                               f"= {r['recv_balance']:.2f}"),
        ("predicted sync", f"{r['predicted_seconds']:.3f} s at {r['nic_gbps']:g} Gb/s/GPU "
                           f"(+{over:.1f}% over the physical bound; {r['bottleneck']})"),
        ("physical bound", f"{r['physical_bound_seconds']:.3f} s: busiest NIC under any schedule (engine rank "
                           f"receives {_gb(r['max_recv_bytes'])}, owner sends {_gb(r['max_owner_unique_bytes'])} "
                           f"only it holds)"),
        ("direct bound", f"{r['direct_bound_seconds']:.3f} s: busiest NIC if trainers write every replica"),
        ("rank-0 baseline", f"{_secs(r['rank0_predicted_seconds'])} ({baseline_ratio(r['rank0_predicted_seconds'], r['predicted_seconds'])})"),
        ("time to plan", f"{r['plan_seconds']:.2f} s (layouts {r['layout_seconds']:.2f} s, "
                         f"planner+hash {r['planner_seconds']:.2f} s; {r['plan_cpu_seconds']:.2f} s CPU)"),
        ("plan hash", r["plan_hash"]),
    ]
    if "delta" in r:
        d = r["delta"]
        rows.append(("delta sync", f"{d['predicted_seconds']:.3f} s at {100 * d['fraction']:g}% changed: "
                                   f"{_gb(d['bytes_total'])} ({d['bytes_total'] / r['bytes_total']:.3f} of dense), "
                                   f"max {_gb(d['max_recv_bytes'])} per engine rank; {d['bottleneck']}"))
    pad = r["padded"]
    if pad["tensors"]:
        ex = pad["examples"][0]
        rows.append(("engine pads", f"{pad['tensors']} tensors on the planned ranks ({_gb(pad['padding_bytes'])} of "
                                    f"padding never written), e.g. rank {ex['rank']} {ex['tensor']} logical "
                                    f"{tuple(ex['logical'])} in engine {tuple(ex['engine'])}"))
    if r["unread_params"]:
        rows.append(("not sent (tied)", ", ".join(r["unread_params"])))
    if r["saved_to"]:
        rows.append(("saved", r["saved_to"]))
    for key, what in (("trace_file", "trace"), ("plot_file", "figure")):
        if r.get(key):
            rows.append((what, r[key]))
    for k, v in rows:
        print(f"{k:20} {v}")
    return 0
