"""A trainer rank's FSDP2 shards under the host's parameter names, for a host that hands fastsync
its module and copies the local shards into registered memory before every sync (the shards'
storage may move between syncs, e.g. with parameter offload, so they are not registered as they
are). Each rank's copy is about 1/N of the model; nothing is gathered.
"""

from __future__ import annotations

from typing import Any

import torch

from fastsync.errors import ConfigError
from fastsync.layout.dtensor import trainer_layout_from_module
from fastsync.layout.types import ParamSpec, TrainerLayout

__all__ = ["local_shard", "renamed_shard_layout", "copy_local_shards"]


def local_shard(t: Any) -> torch.Tensor:
    """This rank's bytes of ``t`` (a DTensor's local shard, a plain tensor as is), detached."""
    from torch.distributed.tensor import DTensor

    return (t.to_local() if isinstance(t, DTensor) else t).detach()


def renamed_shard_layout(module: Any, rank: int, world_size: int, names: dict[str, str], *,
                         description: str) -> tuple[TrainerLayout, dict[str, str]]:
    """The trainer layout of ``module``'s DTensor placements under the host's names (``names``:
    state_dict name -> host name; identical on every rank), and ``{host name: state_dict name}``
    of the parameters this rank holds a shard of."""
    layout = trainer_layout_from_module(module, rank, world_size)
    params = {names[n]: ParamSpec(names[n], tuple(p.shape), p.dtype) for n, p in layout.params.items()}
    trainer = TrainerLayout(world_size, params, {names[n]: tuple(layout.shards[n]) for n in layout.params},
                            kind="fsdp", description=description)
    trainer.validate()
    mine = trainer.shards_on(rank)
    return trainer, {hf: sd for sd, hf in names.items() if hf in mine}


def copy_local_shards(module: Any, local_names: dict[str, str], sources: dict[str, torch.Tensor], rank: int) -> None:
    """Copy this rank's local shards into ``sources`` (registered views, by host name); ConfigError
    naming the parameter when one disappeared or changed shape or dtype since the plan."""
    state = module.state_dict(keep_vars=True)
    for hf, sd in local_names.items():
        t = state.get(sd)
        if t is None:
            raise ConfigError(f"fastsync trainer rank {rank}: parameter {sd!r} disappeared since the plan")
        local, dst = local_shard(t), sources[hf]
        if tuple(local.shape) != tuple(dst.shape) or local.dtype != dst.dtype:
            raise ConfigError(f"fastsync trainer rank {rank}: local shard of {sd!r} is {tuple(local.shape)} "
                              f"{local.dtype}, the plan expects {tuple(dst.shape)} {dst.dtype}; the model changed")
        dst.copy_(local)
