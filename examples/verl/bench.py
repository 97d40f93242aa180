"""Time verl's weight sync through the ``fastsync`` backend on this host, three ways, on real
processes: T trainer processes holding an FSDP2-sharded model (gloo) -> 1 rollout rank.

    python examples/verl/bench.py --trainers 2 --size-mb 64 --syncs 4 [--model dense|moe] [--json]

* ``fulltensor``: verl's interface path: every trainer rank gathers every parameter
  (``full_tensor()``, as verl's ``get_per_tensor_param`` does for FSDP2) and sends its 1/T share.
* ``inplace``: every trainer rank sends from its own FSDP2 shard (``fastsync_verl.shards``):
  no ``full_tensor()`` anywhere.
* ``rank0``: every rank gathers, only trainer rank 0 sends (verl's built-in nccl/nixl backends).

``--model moe``: transformers' own Qwen3-MoE (v5 packed experts, awkward sizes) instead of the
dense layers; ``fulltensor`` and ``rank0`` then send what verl's export yields (``unfuse_moe_params``:
every expert's gate/up/down split out of the gathered packed tensors), ``inplace`` sends each rank's
shard of the packed tensors as they are (into vLLM, the engine's plan maps them onto its fused
``w13_weight``/``w2_weight``; here the rollout rank holds them under the trainer's names).

Per path: median seconds per sync over the replayed syncs (the first plans and registers), from
the trainers' start until the rollout rank holds every tensor; ``verified``: every received tensor
equals the trainer model's, bit for bit, every sync; ``engine_stall_seconds``: the rollout rank's
time in ``receive_weights`` per sync (verl pauses generation around it). Figures, not assertions:
on one CPU host the WRITE is a memcpy. A CPU measurement of the adapter into rollout buffers (not a
verl job), so it lives with the examples, not in the wheel.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import sys
import time

import torch

from fastsync import SyncError
from fastsync.procs import rank_context
from fastsync_verl.checkpoint_engine import FastSyncCheckpointEngine

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the rank context hands sys.path to the trainers
from bench_trainer import MODELS, bench_model, reference, train_step, trainer  # noqa: E402

PATHS = ("fulltensor", "inplace", "rank0")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _recv(conn, what: str, timeout_s: float) -> dict:
    if not conn.poll(timeout_s):
        raise SyncError(f"bench: {what} did not answer within {timeout_s:.0f} s")
    msg = conn.recv()
    if "error" in msg:
        raise SyncError(f"bench: {msg['error']}")
    return msg


def run_path(path: str, trainers: int, size_bytes: int, syncs: int, timeout_s: float = 300,
             kind: str = "dense") -> dict:
    ctx = rank_context()
    port = _port()
    pipes = [ctx.Pipe() for _ in range(trainers)]
    procs = [ctx.Process(target=trainer, args=(r, trainers, port, pipes[r][1], path, size_bytes, syncs, kind),
                         daemon=True)
             for r in range(trainers)]
    for p in procs:
        p.start()
    senders = trainers if path != "rank0" else 1
    rollout = FastSyncCheckpointEngine(bucket_size=512 << 20, control_host="127.0.0.1", timeout_s=120)
    want = bench_model(size_bytes, 1, kind)
    seconds, stalls, full_calls, checks = [], [], [], []
    try:
        for k in range(1, syncs + 1):
            train_step(want, k)
            meta = [_recv(pipes[r][0], f"trainer rank {r} (prepare)", timeout_s) for r in range(senders)]
            a_kw, r_kw = FastSyncCheckpointEngine.build_topology(senders, 1, meta + [rollout.prepare()])
            for r in range(senders):
                pipes[r][0].send({key: v[r] for key, v in a_kw.items()})
            rollout.init_process_group(**{key: v[0] for key, v in r_kw.items()})
            sd = reference(want, path, kind)
            got: set[str] = set()

            async def receive() -> tuple[bool, float, float]:
                ok = True
                t0 = time.perf_counter()
                async for n, t in rollout.receive_weights():
                    ok = ok and n in sd and torch.equal(t, sd[n])
                    got.add(n)
                return ok and got == set(sd), t0, time.perf_counter()

            ok, t0, t1 = asyncio.run(receive())
            rollout.finalize()
            reports = [_recv(pipes[r][0], f"trainer rank {r} (sync {k})", timeout_s) for r in range(trainers)]
            checks.append(ok)  # every sync's tensors compared with the trainer's, none left out
            seconds.append(max(r["seconds"] for r in reports))
            stalls.append(t1 - t0)
            full_calls.append(sum(r["full_tensor"] for r in reports))
    finally:
        rollout.close()
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    steady = seconds[1:] or seconds
    return {"seconds_median": round(statistics.median(steady), 4), "seconds_first": round(seconds[0], 4),
            "verified": len(checks) == syncs and all(checks), "verified_syncs": f"{sum(checks)}/{syncs}",
            "trainer_full_tensor_calls": full_calls[-1],
            "engine_stall_seconds": round(statistics.median(stalls[1:] or stalls), 4)}


def run(trainers: int, size_bytes: int, syncs: int, paths: tuple[str, ...] = PATHS, kind: str = "dense") -> dict:
    m = bench_model(size_bytes, 1, kind)
    model_bytes = sum(p.nbytes for p in m.parameters())
    res = {path: run_path(path, trainers, size_bytes, syncs, kind=kind) for path in paths}
    out: dict = {"model": kind, "trainers": trainers, "rollouts": 1, "model_bytes": model_bytes,
                 "tensors_sent": {path: len(reference(m, path, kind)) for path in paths}, "syncs": syncs,
                 "paths": res}
    if "inplace" in res:
        out["inplace"] = {k: res["inplace"][k] for k in ("trainer_full_tensor_calls", "engine_stall_seconds")}
        if "fulltensor" in res:
            out["speedup_inplace_vs_fulltensor"] = round(res["fulltensor"]["seconds_median"]
                                                         / res["inplace"]["seconds_median"], 2)
        if "rank0" in res:
            out["speedup_inplace_vs_rank0"] = round(res["rank0"]["seconds_median"]
                                                    / res["inplace"]["seconds_median"], 2)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python examples/verl/bench.py", description=__doc__.splitlines()[0])
    ap.add_argument("--trainers", type=int, default=2)
    ap.add_argument("--size-mb", type=int, default=64)
    ap.add_argument("--syncs", type=int, default=4)
    ap.add_argument("--model", choices=MODELS, default="dense",
                    help="dense layers, or transformers' Qwen3-MoE with packed experts")
    ap.add_argument("--paths", default=",".join(PATHS), help=f"comma-separated subset of {PATHS}")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    paths = tuple(p for p in a.paths.split(",") if p)
    bad = [p for p in paths if p not in PATHS]
    if bad:
        ap.error(f"--paths: unknown {bad}; known {PATHS}")
    if a.json:  # NIXL's C++ logs go to fd 1, in this process and the trainers': keep stdout for the JSON
        sys.stdout.flush()
        saved = os.dup(1)
        os.dup2(2, 1)
        try:
            res = run(a.trainers, a.size_mb << 20, max(2, a.syncs), paths, a.model)
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
        print(json.dumps(res))
        return 0 if _ok(res) else 1
    res = run(a.trainers, a.size_mb << 20, max(2, a.syncs), paths, a.model)
    print(f"verl backend 'fastsync': {a.trainers} FSDP2 trainer processes -> 1 rollout rank, {a.model} model, "
          f"{res['model_bytes'] / 2**20:.0f} MiB fp32, {res['syncs']} syncs")
    print(f"{'path':<12}{'s/sync':>10}{'first s':>10}{'stall s':>10}{'full_tensor':>13}{'verified':>10}")
    for p, r in res["paths"].items():
        print(f"{p:<12}{r['seconds_median']:>10}{r['seconds_first']:>10}{r['engine_stall_seconds']:>10}"
              f"{r['trainer_full_tensor_calls']:>13}{str(r['verified']).lower():>10}")
    if "speedup_inplace_vs_fulltensor" in res:
        print(f"inplace vs fulltensor: {res['speedup_inplace_vs_fulltensor']}x")
    if "speedup_inplace_vs_rank0" in res:
        print(f"inplace vs rank0 (verl's built-in backends): {res['speedup_inplace_vs_rank0']}x")
    return 0 if _ok(res) else 1


def _ok(res: dict) -> bool:
    """The exit verdict: every sync of every path delivered exactly the trainer's tensors."""
    return all(r["verified"] for r in res["paths"].values())


if __name__ == "__main__":
    raise SystemExit(main())
