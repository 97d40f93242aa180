"""Time the verl backend on this host: N trainer ranks -> R rollout ranks, in one process
(threads standing in for verl's actors; real NIXL agents and a TCPStore control plane).

    python -m fastsync_verl.bench --trainers 2 --rollouts 1 --size-mb 256 --syncs 4
    python -m fastsync_verl.bench --senders rank0 ...    # only trainer rank 0 sends (as verl's nccl/nixl)
    ... --json                                             # one JSON object instead of the table

The first sync plans and registers; the table reports the later (replayed) syncs. Figures, not
assertions: on one CPU host the WRITE is a memcpy charged to the sender, so splitting it over
trainer ranks is what the comparison shows.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import threading
import time

import torch

from fastsync import SyncError
from fastsync_verl.checkpoint_engine import FastSyncCheckpointEngine


def _weights(size_bytes: int, version: int) -> list[tuple[str, torch.Tensor]]:
    """Qwen-like tensors in bf16: 4096-wide matrices of mixed heights, norms in fp32."""
    g = torch.Generator().manual_seed(version)
    out, total, i = [], 0, 0
    while total < size_bytes:
        rows = (1024, 4096, 512, 2048)[i % 4]
        t = torch.randn(rows, 4096, generator=g).bfloat16()
        out.append((f"model.layers.{i // 4}.w{i % 4}.weight", t))
        out.append((f"model.layers.{i // 4}.norm{i % 4}.weight", torch.randn(4096, generator=g)))
        total += t.nbytes + 4096 * 4
        i += 1
    return out


def run(trainers: int, rollouts: int, size_bytes: int, syncs: int, senders: str) -> dict:
    active = trainers if senders == "all" else 1
    kw = {"control_host": "127.0.0.1", "timeout_s": 120}
    actors = [FastSyncCheckpointEngine(bucket_size=512 << 20, is_master=(r == 0), **kw) for r in range(active)]
    rolls = [FastSyncCheckpointEngine(bucket_size=512 << 20, **kw) for _ in range(rollouts)]
    times, sent = [], {}
    try:
        for version in range(1, syncs + 1):
            weights = _weights(size_bytes, version)
            meta = [e.prepare() for e in actors + rolls]
            akw, rkw = FastSyncCheckpointEngine.build_topology(active, rollouts, meta)
            for i, e in enumerate(actors):
                e.init_process_group(**{k: v[i] for k, v in akw.items()})
            for i, e in enumerate(rolls):
                e.init_process_group(**{k: v[i] for k, v in rkw.items()})
            errors: list[BaseException] = []

            def send(r: int) -> None:
                try:
                    sent[r] = asyncio.run(actors[r].send_weights(iter(weights)))[f"fastsync/trainer{r}/sent_bytes"]
                except BaseException as e:
                    errors.append(e)

            def recv(e: FastSyncCheckpointEngine) -> None:
                async def go() -> None:
                    async for _ in e.receive_weights():
                        pass
                try:
                    asyncio.run(go())
                except BaseException as err:
                    errors.append(err)

            threads = [threading.Thread(target=send, args=(r,)) for r in range(active)]
            threads += [threading.Thread(target=recv, args=(e,)) for e in rolls]
            t0 = time.perf_counter()
            for t in threads:
                t.start()
            for t in threads:
                t.join(300)
            dt = time.perf_counter() - t0
            if errors or any(t.is_alive() for t in threads):
                raise SyncError(f"sync {version} failed: {errors[:1] or 'timed out'}")
            for e in actors + rolls:
                e.finalize()
            times.append(dt)
    finally:
        for e in actors + rolls:
            e.close()
    steady = times[1:] or times
    nbytes = sum(t.nbytes for _, t in _weights(size_bytes, 0)) * rollouts
    return {"trainers": trainers, "rollouts": rollouts, "senders": senders, "model_bytes": nbytes // rollouts,
            "first_sync_s": round(times[0], 4), "sync_s_median": round(statistics.median(steady), 4),
            "sync_s_best": round(min(steady), 4), "GBps_best": round(nbytes / min(steady) / 1e9, 3),
            "sent_bytes_per_trainer": [int(sent.get(r, 0)) for r in range(trainers)], "threads": torch.get_num_threads()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m fastsync_verl.bench", description=__doc__.splitlines()[0])
    ap.add_argument("--trainers", type=int, default=2)
    ap.add_argument("--rollouts", type=int, default=1)
    ap.add_argument("--size-mb", type=int, default=256)
    ap.add_argument("--syncs", type=int, default=4)
    ap.add_argument("--senders", choices=("all", "rank0"), default="all")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    res = run(a.trainers, a.rollouts, a.size_mb << 20, max(2, a.syncs), a.senders)
    if a.json:
        print(json.dumps(res))
        return 0
    print(f"verl backend 'fastsync': {a.trainers} trainer -> {a.rollouts} rollout ranks, "
          f"{res['model_bytes'] / 2**20:.0f} MiB, senders={a.senders}")
    for key in ("first_sync_s", "sync_s_median", "sync_s_best", "GBps_best"):
        print(f"{key:<24}{res[key]:>12}")
    print(f"{'sent MiB per trainer':<24}{' '.join(f'{b / 2**20:.1f}' for b in res['sent_bytes_per_trainer']):>12}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
