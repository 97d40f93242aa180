"""One trainer-rank process of ``examples/verl/bench.py``: a model sharded with FSDP2
``fully_shard`` over gloo, handing the ``fastsync`` backend either verl's full tensors (what
verl's ``FSDPEngine.get_per_tensor_param`` yields for FSDP2: ``full_tensor()`` per parameter, on
every rank) or its local shards (``ShardedWeights``, what ``fastsync_verl.shards`` hands over)."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import torch

HIDDEN = 1000
ROWS = (1031, 4000, 517, 2047)


def bench_model(size_bytes: int, seed: int) -> torch.nn.Module:
    """Linear layers 1000 wide with awkward heights, plus norms, about ``size_bytes`` in fp32."""
    torch.manual_seed(seed)
    m = torch.nn.Module()
    m.layers = torch.nn.ModuleList()
    total, i = 0, 0
    while total < size_bytes:
        lin = torch.nn.Linear(HIDDEN, ROWS[i % 4], bias=False)
        m.layers.append(torch.nn.ModuleDict({"proj": lin, "norm": torch.nn.LayerNorm(HIDDEN)}))
        total += lin.weight.nbytes + 2 * HIDDEN * 4
        i += 1
    return m


def train_step(m: torch.nn.Module, k: int) -> None:
    with torch.no_grad():
        for p in m.parameters():  # in place on the local shards, as an optimizer step
            p.mul_(0.999).add_(1e-3 * k)


def trainer(rank: int, world: int, port: int, conn: Any, path: str, size_bytes: int, syncs: int) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from fastsync_verl.checkpoint_engine import FastSyncCheckpointEngine
    from fastsync_verl.shards import ShardedWeights

    calls = {"n": 0}
    orig = DTensor.full_tensor

    def counted(self: Any, *a: Any, **kw: Any) -> torch.Tensor:
        calls["n"] += 1
        return orig(self, *a, **kw)

    DTensor.full_tensor = counted  # type: ignore[method-assign]
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        m = bench_model(size_bytes, 1)
        for layer in m.layers:
            fully_shard(layer["proj"])
            fully_shard(layer["norm"])
        fully_shard(m)
        sends = path != "rank0" or rank == 0
        engine = (FastSyncCheckpointEngine(bucket_size=512 << 20, is_master=rank == 0, control_host="127.0.0.1",
                                           timeout_s=120, trainer_shards="on" if path == "inplace" else "off")
                  if sends else None)
        for k in range(1, syncs + 1):
            train_step(m, k)
            if engine is not None:
                conn.send(engine.prepare())
                engine.init_process_group(**conn.recv())
            before = calls["n"]
            dist.barrier()
            t0 = time.perf_counter()
            state = m.state_dict()
            full = ((n, p.full_tensor() if isinstance(p, DTensor) else p) for n, p in state.items())
            if engine is None:  # rank0 path, other ranks: join every all-gather, send nothing
                for _ in full:
                    pass
                metrics: dict = {}
            else:
                weights = ShardedWeights(full, m) if path == "inplace" else full
                metrics = asyncio.run(engine.send_weights(weights, global_steps=k))
                engine.finalize()
            conn.send({"seconds": time.perf_counter() - t0, "full_tensor": calls["n"] - before, "metrics": metrics})
        if engine is not None:
            engine.close()
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001
        conn.send({"error": f"trainer rank {rank}: {type(e).__name__}: {e}"})
