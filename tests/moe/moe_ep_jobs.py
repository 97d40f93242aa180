"""The job each expert-parallel test process runs (imported by the spawned processes)."""

from __future__ import annotations

import torch
import torch.distributed as dist

import fastsync.moe as fm
from fastsync.moe.block import FastExperts
from fastsync.moe.presets import ARCH_TINY, build_model


def model_job(job: dict, rank: int, world: int, group) -> dict:
    """Patch a tiny model with EP over ``group``, run this rank's micro-batch forward+backward.

    Returns this rank's outputs; rank 0 also returns the full gradients (expert shards
    all-gathered, replicated parameters' gradients summed over ranks, as data parallelism would)
    and the gathered ``state_dict()``.
    """
    model = build_model({**ARCH_TINY[job["arch"]], **job.get("overrides", {})}, job["seed"])
    device = job.get("device", "cpu")
    model = model.to(device=device, dtype=getattr(torch, job.get("dtype", "float32")))
    fm.patch(model, ep_group=group, backend=job.get("backend", "auto"))
    ids = job["ids"].to(device)
    per = ids.shape[0] // world
    mine = ids[rank * per : (rank + 1) * per]
    out = model(input_ids=mine, labels=mine, output_router_logits=True)
    out.loss.backward()
    shards = fm.ep_shards(model)
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        if name in shards:
            parts = [torch.empty_like(g) for _ in range(world)]
            dist.all_gather(parts, g.contiguous(), group=group)
            grads[name] = torch.cat(parts, 0)
        else:
            g = g.clone()
            dist.all_reduce(g, group=group)
            grads[name] = g
    sd = model.state_dict()  # collective under EP
    res = {
        "logits": out.logits.detach(),
        "loss": out.loss.detach(),
        "expert_param_bytes": fm.expert_param_bytes(model),
        "local_shapes": {n: tuple(p.shape) for n, p in model.named_parameters() if n in shards},
        "dispatch": sorted({m.dispatch for m in model.modules() if isinstance(m, FastExperts)}),
    }
    if getattr(out, "aux_loss", None) is not None:
        res["aux_loss"] = out.aux_loss.detach()
    if rank == 0:
        res["grads"] = grads
        res["state_dict"] = {k: v.clone() for k, v in sd.items()}
    return res


def multi_job(job: dict, rank: int, world: int, group) -> dict:
    """Several EP runs in one set of processes (imports cost more than the runs): run ``i`` uses
    the first ``job["runs"][i]["world"]`` ranks as its EP group; other ranks sit it out."""
    sizes = sorted({r["world"] for r in job["runs"]})
    groups = {s: (group if s == world else dist.new_group(list(range(s)))) for s in sizes}  # same order on all ranks
    out = {}
    for i, run_job in enumerate(job["runs"]):
        s = run_job["world"]
        if rank < s:
            out[i] = model_job(run_job, rank, s, groups[s])
    return out


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    return obj


def deepep_job(job: dict, rank: int, world: int, group) -> dict:
    """On GPU ``rank`` of an NCCL group: ``model_job`` in bf16 (DeepEP's dispatch and combine take
    bf16 only) twice over the same group, same weights and micro-batch: ``backend="deepep"``
    (DeepEP's normal-mode dispatch/combine through a ``deep_ep.Buffer``), then ``backend="torch"``
    (the all-to-all dispatcher the CPU EP tests hold to HF's model). Results on the CPU."""
    import gc

    out = {}
    for key, backend in (("deepep", "deepep"), ("all_to_all", "torch")):
        res = model_job({**job, "backend": backend, "device": f"cuda:{rank}", "dtype": "bfloat16"}, rank, world, group)
        out[key] = _to_cpu(res)
        del res
        gc.collect()  # the DeepEP buffers go while the group still lives
        torch.cuda.synchronize()
        dist.barrier(group=group)
    return out
