"""Owner gathers: the full tensors some transfers read (``Plan.gathers``), assembled on one rank.

The planner sends a piece from an *owner* that first gathers the whole parameter when the
trainer's shards cut a quantisation block, or would cut a small tensor into many tiny parts (as
FSDP's ``full_tensor()``, but only on the owner, not on every rank). Before packing, every
trainer rank holding a shard of such a parameter sends it to the owner over the trainers'
torch.distributed group (point-to-point, gloo or NCCL); the owner receives into a full buffer
allocated and touched once. Replicated boxes are sent once, by their lowest rank.
"""

from __future__ import annotations

from typing import Any

import torch

from fastsync.errors import ConfigError
from fastsync.executor.metrics import SyncMetrics
from fastsync.executor.staging import torch_dtype
from fastsync.layout.box import Box, box_numel, box_shape, box_slices, contiguous_runs
from fastsync.layout.types import Shard, TrainerLayout
from fastsync.plan.types import Plan

__all__ = ["OwnerGather"]


class OwnerGather:
    """Per sync, gather the parameters this rank owns and send the shards others own.

    ``group``: the process group whose rank ``r`` is trainer rank ``r`` (``None``: the default
    group, where trainer rank ``r`` is global rank ``r``, as in an FSDP trainer's world or
    fastsync's own trainer+inference world).
    """

    def __init__(self, rank: int, plan: Plan, layout: TrainerLayout, sources: dict[str, torch.Tensor],
                 group: Any = None) -> None:
        self.rank = rank
        self.group = group
        self.full: dict[str, torch.Tensor] = {}
        self._recv: list[tuple[int, torch.Tensor, torch.Tensor | None, str]] = []  # (src, buffer, copy-to, param)
        self._send: list[tuple[int, torch.Tensor, str]] = []  # (owner, view, param)
        for name in sorted(plan.gathers):
            owner = plan.gathers[name]
            spec = layout.params[name]
            seen: dict[Box, Shard] = {}
            for sh in sorted(layout.shards[name], key=lambda s: s.rank):
                if box_numel(sh.box) and sh.box not in seen:
                    seen[sh.box] = sh
            if owner == rank:
                full = torch.empty(spec.shape, dtype=torch_dtype(spec.dtype))
                full.zero_()  # touch once
                self.full[name] = full
                for box, sh in seen.items():
                    dst = full[box_slices(box)]
                    if sh.rank == rank:
                        self._recv.append((rank, _local(sources, name, sh), dst, name))
                    elif len(contiguous_runs(box, spec.shape)) == 1:
                        self._recv.append((sh.rank, dst, None, name))
                    else:
                        tmp = torch.empty(box_shape(box), dtype=full.dtype)
                        self._recv.append((sh.rank, tmp, dst, name))
            else:
                for box, sh in seen.items():
                    if sh.rank == rank:
                        self._send.append((owner, _local(sources, name, sh), name))

    @property
    def needed(self) -> bool:
        return bool(self._recv or self._send)

    def check(self) -> None:
        import torch.distributed as dist

        if self.needed and not dist.is_initialized():
            raise ConfigError(
                f"trainer rank {self.rank}: the plan gathers full tensors (e.g. "
                f"{(self._recv or self._send)[0][-1]!r}) over the trainers' torch.distributed group, and none is "
                "initialised"
            )

    def _peer(self, r: int) -> int:
        import torch.distributed as dist

        return r if self.group is None else dist.get_global_rank(self.group, r)

    def run(self, deadline: float, metrics: SyncMetrics) -> None:
        import torch.distributed as dist

        from fastsync.transport._dist import wait_work

        if not self.needed:
            return
        with metrics.stage("gather"):
            works = []
            for owner, view, name in self._send:
                works.append((dist.isend(view, dst=self._peer(owner), group=self.group),
                              f"gather: trainer rank {self.rank} sending its shard of {name!r} to owner rank {owner}"))
            for src, buf, dst, name in self._recv:
                if src == self.rank:
                    assert dst is not None
                    dst.copy_(buf)
                else:
                    works.append((dist.irecv(buf, src=self._peer(src), group=self.group),
                                  f"gather: owner rank {self.rank} receiving {name!r} from trainer rank {src}"))
            for w, what in works:
                wait_work(w, deadline, what)
            for src, buf, dst, _ in self._recv:
                if src != self.rank and dst is not None:
                    dst.copy_(buf)


def _local(sources: dict[str, torch.Tensor], name: str, sh: Shard) -> torch.Tensor:
    buf = sources.get(name)
    if buf is None:
        raise ConfigError(f"trainer rank {sh.rank} holds a shard of {name!r} but has no local tensor for it")
    n = box_numel(sh.box)
    return buf.reshape(-1)[sh.local_offset: sh.local_offset + n].view(box_shape(sh.box))
