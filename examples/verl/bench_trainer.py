"""One trainer-rank process of ``examples/verl/bench.py``: a model sharded with FSDP2
``fully_shard`` over gloo, handing the ``fastsync`` backend either verl's full tensors (what
verl's ``FSDPEngine.get_per_tensor_param`` yields for FSDP2: ``full_tensor()`` per parameter, on
every rank, and for a MoE model verl's own ``unfuse_moe_params`` over them) or its local shards
(``ShardedWeights``, what ``fastsync_verl.shards`` hands over).

Two models: ``dense`` (linear layers with awkward heights) and ``moe`` (transformers' own
``Qwen3MoeForCausalLM`` with v5's packed experts, awkward sizes: vocab 1001, hidden 360, 5 heads
of 72 over 1 KV head, 13 experts of intermediate 200)."""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import torch

HIDDEN = 1000
ROWS = (1031, 4000, 517, 2047)


MODELS = ("dense", "moe")
MOE_TYPE = "qwen3_moe"
_MOE = {"vocab_size": 1001, "hidden_size": 360, "intermediate_size": 500, "moe_intermediate_size": 200,
        "num_attention_heads": 5, "num_key_value_heads": 1, "head_dim": 72, "num_experts": 13,
        "num_experts_per_tok": 2, "norm_topk_prob": True, "decoder_sparse_step": 1, "tie_word_embeddings": False}


def bench_model(size_bytes: int, seed: int, kind: str = "dense") -> torch.nn.Module:
    """About ``size_bytes`` of fp32 weights: ``dense``, linear layers 1000 wide with awkward
    heights plus norms; ``moe``, transformers' Qwen3-MoE with as many decoder layers as fit."""
    torch.manual_seed(seed)
    if kind == "moe":
        import transformers

        h, e, i, v = _MOE["hidden_size"], _MOE["num_experts"], _MOE["moe_intermediate_size"], _MOE["vocab_size"]
        d, q, kv = _MOE["head_dim"], _MOE["num_attention_heads"], _MOE["num_key_value_heads"]
        # experts, router, q/k/v and o projections, two norms, q/k norms (fp32 bytes)
        per_layer = 4 * (3 * e * h * i + e * h + h * d * (q + 2 * kv) + q * d * h + 2 * h + 2 * d)
        layers = max(1, (size_bytes - 4 * 2 * v * h) // per_layer)
        config = transformers.Qwen3MoeConfig(**_MOE, num_hidden_layers=int(layers))
        return transformers.Qwen3MoeForCausalLM(config).float()
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


def reference(m: torch.nn.Module, path: str, kind: str) -> dict[str, torch.Tensor]:
    """What the rollout rank should hold after a sync on ``path``: the trainer's tensors under the
    names that path sends (verl's full tensors un-fuse packed experts; the shards keep them)."""
    sd = m.state_dict()
    if kind == "moe" and path != "inplace":
        from verl.workers.engine.fsdp.utils import unfuse_moe_params

        return dict(unfuse_moe_params(sd.items(), MOE_TYPE))
    return sd


def _shard(m: torch.nn.Module, kind: str) -> None:
    from torch.distributed.fsdp import fully_shard

    if kind == "moe":  # as verl's FSDP2 engine wraps a HF model: each decoder layer, then the root
        for layer in m.model.layers:
            fully_shard(layer)
    else:
        for layer in m.layers:
            fully_shard(layer["proj"])
            fully_shard(layer["norm"])
    fully_shard(m)


def trainer(rank: int, world: int, port: int, conn: Any, path: str, size_bytes: int, syncs: int,
            kind: str = "dense") -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch.distributed as dist
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
        m = bench_model(size_bytes, 1, kind)
        _shard(m, kind)
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
            if kind == "moe":  # what verl's FSDPEngine.get_per_tensor_param does for a v5 MoE model
                from verl.workers.engine.fsdp.utils import unfuse_moe_params

                full = unfuse_moe_params(full, MOE_TYPE)
            if engine is None:  # rank0 path, other ranks: join every all-gather, send nothing
                for _ in full:
                    pass
                metrics: dict = {}
            else:
                weights = ShardedWeights(full, m) if path == "inplace" else full
                metrics = asyncio.run(engine.send_weights(weights, global_steps=k))
                engine.finalize()
            conn.send({"seconds": time.perf_counter() - t0, "full_tensor": calls["n"] - before, "metrics": metrics})
        dist.barrier()  # trainer rank 0 hosts the control store: it must outlive every rank's last sync
        if engine is not None:
            engine.close()
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001
        conn.send({"error": f"trainer rank {rank}: {type(e).__name__}: {e}"})
