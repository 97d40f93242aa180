"""The demo's rank-0 baseline: what verl's NCCL checkpoint engine does with an FSDP2 trainer.

It mirrors ``NCCLCheckpointEngine.send_weights`` (verl/checkpoint_engine/nccl_checkpoint_engine.py)
fed by ``engine.get_per_tensor_param()`` (FSDP: ``full_tensor()`` per parameter on every rank):

1. every rank walks the parameters in order and gathers each one (``DTensor.full_tensor()``, a
   collective); ranks other than 0 drop it at once ("consume weights without sending");
2. rank 0 copies it into its send bucket (one copy, the bucket's; nothing cloned);
3. when the next tensor does not fit, verl waits for the previous bucket's broadcast, starts this
   bucket's broadcast on a helper thread and swaps to the other bucket, so the gather of bucket
   ``k+1`` overlaps the send of bucket ``k``; the last bucket is sent after the loop.

verl's bucket is ``checkpoint_engine.update_weights_bucket_megabytes`` (2048 MiB by default in
``verl/workers/config/rollout.py``; 512 in older configs). The demo's models (34M parameters,
136 MB in float32) fit in one bucket of either size, so verl itself gathers every tensor and then
sends once: there is nothing to overlap, and this baseline does the same. The send is fastsync's
own NIXL writes from trainer rank 0's bucket (a one-rank trainer world holding full tensors),
not NCCL's broadcast, so the baseline and fastsync differ only in who gathers and who sends.
A model larger than one bucket is refused here: the engine takes one session per sync, so
per-bucket sends with their overlap cannot be mirrored faithfully (``fastsync bench --transport
rank0`` runs the double-buffered pattern between processes, ``fastsync/transport/rank0.py``).

OpenRLHF's ``ActorPPOTrainer.broadcast_to_vllm`` is slower still (per parameter: ZeRO-3 gather,
then one broadcast and a ``ray.get``; no buckets), so verl's pattern is the fairer comparison.
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["MIRRORS", "VERL_BUCKET_BYTES", "rank0_baseline"]

#: What the baseline stands for, as the demo prints it.
MIRRORS = ("verl NCCLCheckpointEngine.send_weights (verl/checkpoint_engine/nccl_checkpoint_engine.py): "
           "full_tensor() per parameter on every rank, rank 0 fills its bucket and alone sends it")

#: verl's default ``update_weights_bucket_megabytes`` (``CheckpointEngineConfig``): one bucket.
VERL_BUCKET_BYTES = 2048 << 20


def _full(t: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t.detach()


def rank0_baseline(model: Any, rank: int, control: Any, engine: Any, port: int, opts: dict, version: int,
                   timeout: float, repeats: int) -> tuple[list[float], list[float], dict, int]:
    """Run ``repeats`` baseline syncs on every trainer rank (``version`` + 1 onwards). Returns the
    seconds of each sync, the seconds of each gather (bucket filled), rank 0's bucket as named
    full tensors (empty on other ranks) and the last version."""
    import torch
    import torch.distributed as dist

    from fastsync.errors import ConfigError
    from fastsync.layout.box import full_box
    from fastsync.layout.types import ParamSpec, Shard, TrainerLayout
    from fastsync.sync import WeightSync

    state = model.state_dict(keep_vars=True)
    names = list(state)
    shapes = {n: tuple(state[n].shape) for n in names}
    dtypes = {n: state[n].dtype for n in names}
    sizes = [state[n].numel() * state[n].element_size() for n in names]
    if sum(sizes) > VERL_BUCKET_BYTES:
        raise ConfigError(f"the demo's rank-0 baseline mirrors one verl bucket of {VERL_BUCKET_BYTES >> 20} MiB; this "
                          f"model is {sum(sizes) >> 20} MiB (use --no-baseline, or fastsync bench --transport rank0)")
    held: dict[str, torch.Tensor] = {}
    base = None
    if rank == 0:  # the bucket: one flat buffer, each parameter a view at its offset (verl's bucket_meta)
        bucket = torch.empty(sum(sizes), dtype=torch.uint8)
        off = 0
        for n, nb in zip(names, sizes):
            held[n] = bucket[off: off + nb].view(dtypes[n]).view(shapes[n])
            off += nb
        params = {n: ParamSpec(n, shapes[n], str(dtypes[n]).removeprefix("torch.")) for n in names}
        layout = TrainerLayout(1, params, {n: (Shard(0, full_box(params[n].shape)),) for n in names},
                               kind="rank0", description="full tensors gathered into trainer rank 0's bucket")
        base = WeightSync(rank=0, world_size=1, control=control.with_prefix("base"), engines=[engine],
                          transport=opts.get("transport", "nixl"), timeout_s=timeout, layout=layout,
                          sources=held, name="base", control_port=port)
        base.setup()
    btimes, gtimes = [], []
    try:
        for _ in range(repeats):
            dist.barrier()
            version += 1
            t0 = time.perf_counter()
            with torch.no_grad():
                for n in names:  # verl: for name, weight in weights (get_per_tensor_param)
                    full = _full(state[n])  # every rank takes part in the gather
                    if rank == 0:
                        held[n].copy_(full)  # send_buf[offset: offset + nbytes] = weight
            g = time.perf_counter() - t0
            if base is not None:  # the one bucket's send (verl: the broadcast after the loop)
                base.sync(version, timeout_s=timeout)
            dist.barrier()  # the other ranks are done when rank 0's send is
            btimes.append(time.perf_counter() - t0)
            gtimes.append(g)
    finally:
        if base is not None:
            base.close()
    return btimes, gtimes, held, version
