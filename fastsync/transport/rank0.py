"""``rank0`` transport: the baseline the host frameworks use today, kept as good as they are.

As verl's NCCL checkpoint backend and OpenRLHF's broadcast path do it: trainer ranks send their
shards of each bucket of parameters to trainer rank 0, which assembles the full tensors in a
bucket buffer and broadcasts the bucket to every engine rank; each engine rank then cuts
its own pieces (TP slices, fused qkv / w13) out of the full tensors. Buckets are double-buffered
on both sides (the broadcast of bucket ``b`` overlaps the gather of ``b+1`` on rank 0 and the
unpacking of ``b-1`` on the receivers), ``bucket_bytes`` each (default 256 MiB, so 512 MiB in
flight, the size of verl's default single bucket). It exists to be compared against, and as the
last-resort fallback where only a torch.distributed group is available.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import torch

from fastsync.errors import ConfigError, TransportError
from fastsync.protocol import rank0_shards_key
from fastsync.executor.metrics import SyncMetrics
from fastsync.executor.pack import source_view
from fastsync.executor.program import RecvItem
from fastsync.executor.staging import alloc_touched, dtype_name, torch_dtype
from fastsync.executor.verify import Digests
from fastsync.layout.box import box_numel, box_shape, box_slices, contiguous_runs
from fastsync.layout.types import DTYPE_BYTES
from fastsync.transport._dist import ensure_world, subgroup, wait_work
from fastsync.transport.base import ReceiverContext, SenderContext, Transport

__all__ = ["Rank0Transport"]


def _write(landing_view: torch.Tensor, it: RecvItem, src: torch.Tensor) -> None:
    from fastsync.executor.pack import transform_into

    t = it.transfer
    dst = landing_view[box_slices(t.dst_box)]
    if t.transform == "copy":
        dst.copy_(src.reshape(dst.shape))
        return
    tmp = torch.empty(t.nbytes, dtype=torch.uint8)
    transform_into(tmp, src, t.transform, dtype_name(landing_view.dtype))
    dst.copy_(tmp.view(landing_view.dtype).view(dst.shape))


class Rank0Transport(Transport):
    """``bucket_bytes``: size of one broadcast bucket (two are allocated per side)."""

    name = "rank0"
    uses_staging = False
    fanout = False  # reads plan.transfers as every engine rank's writes
    rank0_reaches_all = True  # rank 0 broadcasts each bucket to every engine rank

    def __init__(self, bucket_bytes: int = 256 << 20, backend: str = "gloo") -> None:
        super().__init__()
        if bucket_bytes <= 0:
            raise ConfigError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.bucket_bytes = bucket_bytes
        self.backend = backend
        self.buckets: list[dict] = []
        self.bufs: list[torch.Tensor] = []
        self.group: Any = None
        self._items: list[list[RecvItem]] = []
        self._next = 0
        self._work: Any = None
        self._broken = False

    def _join(self, ctx: SenderContext | ReceiverContext, global_rank: int) -> None:
        ensure_world(ctx.control, global_rank, ctx.world.size, ctx.timeout_s, self.backend)
        self.group = subgroup([0] + [ctx.world.receiver(d) for d in range(ctx.world.num_receivers)])

    def _alloc(self) -> None:
        size = max((b["nbytes"] for b in self.buckets), default=0)
        self.bufs = [alloc_touched(size), alloc_touched(size)] if len(self.buckets) > 1 else [alloc_touched(size)]

    @staticmethod
    def _full(buf: torch.Tensor, p: list) -> torch.Tensor:
        name, shape, dtype, off = p[0], tuple(p[1]), p[2], p[3]
        n = box_numel(tuple((0, s) for s in shape)) * DTYPE_BYTES[dtype]
        return buf[off: off + n].view(torch_dtype(dtype)).view(shape)

    # ---- sender -------------------------------------------------------------------------
    def _setup_sender(self, ctx: SenderContext) -> None:
        self._join(ctx, ctx.world.trainer(ctx.rank))
        read = list(dict.fromkeys(t.src_param for t in ctx.plan.transfers))
        mine = {p: [[[list(b) for b in sh.box], sh.local_offset] for sh in ctx.shards.get(p, [])]
                for p in read if p in ctx.sources}
        dtypes = {p: dtype_name(ctx.sources[p].dtype) for p in mine}
        ctx.control.set(rank0_shards_key(ctx.rank), json.dumps({"shards": mine, "dtypes": dtypes}))
        if ctx.rank == 0:
            self.buckets = self._plan_buckets(ctx, read)
            ctx.control.set("rank0/buckets", json.dumps(self.buckets))
            self._alloc()
        else:
            self.buckets = json.loads(ctx.control.get("rank0/buckets", ctx.timeout_s, what="trainer rank 0"))

    def _plan_buckets(self, ctx: SenderContext, read: list[str]) -> list[dict]:
        held: dict[str, dict] = {}
        dtypes: dict[str, str] = {}
        for r in range(ctx.world.num_trainers):
            info = json.loads(ctx.control.get(rank0_shards_key(r), ctx.timeout_s, what=f"trainer rank {r}"))
            dtypes.update(info["dtypes"])
            for p, shards in info["shards"].items():
                for box, loff in shards:
                    key = json.dumps(box)
                    if key not in held.setdefault(p, {}):  # replicas: the lowest rank sends
                        held[p][key] = [r, box, loff]
        buckets: list[dict] = []
        cur: dict | None = None
        for p in read:
            if p not in held:
                raise TransportError(f"rank0: no trainer rank holds a shard of {p!r}")
            srcs = list(held[p].values())
            shape = [max(b[d][1] for _, b, _ in srcs) for d in range(len(srcs[0][1]))]
            n = box_numel(tuple((0, s) for s in shape)) * DTYPE_BYTES[dtypes[p]]
            if cur is None or (cur["nbytes"] + n > self.bucket_bytes and cur["params"]):
                cur = {"nbytes": 0, "params": []}
                buckets.append(cur)
            cur["params"].append([p, shape, dtypes[p], cur["nbytes"], srcs])
            cur["nbytes"] += -(-n // 64) * 64
        return buckets

    def _send(self, version: int, deadline: float, metrics: SyncMetrics, crcs: Digests | None,
              on_chunk: Callable[[int], None] | None) -> None:
        import torch.distributed as dist

        ctx = self.sender
        assert ctx is not None
        if ctx.rank != 0:
            for k, b in enumerate(self.buckets):
                works = []
                with metrics.stage("gather"):
                    for p in b["params"]:
                        for r, box, loff in p[4]:
                            if r == ctx.rank:
                                view = self._local(ctx, p[0], box, loff)
                                # gloo sends from host memory: a CUDA shard is copied down first
                                works.append(dist.isend(view.contiguous() if view.device.type == "cpu"
                                                        else view.cpu(), dst=0))
                    for w in works:
                        wait_work(w, deadline, f"rank0: trainer rank {ctx.rank} sending bucket {k} to rank 0")
                if on_chunk is not None:
                    on_chunk(k)
            return
        by_param: dict[str, list[int]] = {}
        for i, t in enumerate(ctx.plan.transfers):
            by_param.setdefault(t.src_param, []).append(i)
        pending: Any = None
        for k, b in enumerate(self.buckets):
            buf = self.bufs[k % len(self.bufs)]
            works, copies = [], []
            with metrics.stage("gather"):
                for p in b["params"]:
                    full = self._full(buf, p)
                    for r, box, loff in p[4]:
                        bx = tuple(tuple(x) for x in box)
                        dst = full[box_slices(bx)]
                        if r == 0:
                            dst.copy_(self._local(ctx, p[0], box, loff))
                        elif len(contiguous_runs(bx, full.shape)) == 1:
                            works.append(dist.irecv(dst, src=r))
                        else:
                            tmp = torch.empty(box_shape(bx), dtype=full.dtype)
                            works.append(dist.irecv(tmp, src=r))
                            copies.append((dst, tmp))
                for w in works:
                    wait_work(w, deadline, f"rank0: gathering bucket {k} on trainer rank 0")
                for dst, tmp in copies:
                    dst.copy_(tmp)
            if pending is not None:
                with metrics.stage("broadcast"):
                    wait_work(pending, deadline, f"rank0: broadcast of bucket {k - 1}")
            pending = dist.broadcast(buf[: b["nbytes"]], src=0, group=self.group, async_op=True)
            if crcs is not None:
                with metrics.stage("checksum"):
                    self._checksums(ctx, b, buf, by_param, crcs)
            if on_chunk is not None:
                on_chunk(k)
        if pending is not None:
            with metrics.stage("broadcast"):
                wait_work(pending, deadline, f"rank0: broadcast of bucket {len(self.buckets) - 1}")

    def _local(self, ctx: SenderContext, param: str, box: list, loff: int) -> torch.Tensor:
        bx = tuple(tuple(x) for x in box)
        n = box_numel(bx)
        return ctx.sources[param].reshape(-1)[loff: loff + n].view(box_shape(bx))

    def _checksums(self, ctx: SenderContext, b: dict, buf: torch.Tensor, by_param: dict[str, list[int]],
                   crcs: Digests) -> None:
        from fastsync.executor.pack import transform_into

        infos = self._dst_dtypes(ctx)
        for p in b["params"]:
            full = self._full(buf, p)
            for i in by_param.get(p[0], []):
                t = ctx.plan.transfers[i]
                out = torch.empty(t.nbytes, dtype=torch.uint8)
                transform_into(out, full[box_slices(t.src_box)], t.transform, infos[(t.dst_rank, t.dst_tensor)])
                crcs.feed(i, out)

    def _dst_dtypes(self, ctx: SenderContext) -> dict[tuple[int, str], str]:
        return {(d, n): info.dtype for d, ts in ctx.program.dst_info.items() for n, info in ts.items()}

    # ---- receiver -----------------------------------------------------------------------
    def checksum_ranks(self, program: Any) -> list[int]:
        return [0]

    def _setup_receiver(self, ctx: ReceiverContext) -> None:
        self._join(ctx, ctx.world.receiver(ctx.rank))
        self.buckets = json.loads(ctx.control.get("rank0/buckets", ctx.timeout_s, what="trainer rank 0"))
        where = {p[0]: k for k, b in enumerate(self.buckets) for p in b["params"]}
        self._items = [[] for _ in self.buckets]
        for items in ctx.program.by_src.values():
            for it in items:
                if it.transfer.src_param not in where:
                    raise TransportError(f"rank0: trainer rank 0 broadcasts no bucket holding {it.transfer.src_param!r}")
                self._items[where[it.transfer.src_param]].append(it)
        self._alloc()

    def _post(self, k: int) -> None:
        import torch.distributed as dist

        buf = self.bufs[k % len(self.bufs)]
        self._work = dist.broadcast(buf[: self.buckets[k]["nbytes"]], src=0, group=self.group, async_op=True)

    def _begin_receive(self, version: int) -> None:
        if self._broken:
            raise TransportError("rank0: a failed sync left a broadcast pending (gloo cannot cancel it); rebuild the "
                                 "process group before using this transport again")
        self._next = 0
        self._work = None
        if self.buckets:
            self._post(0)

    def _poll_receive(self) -> bool:
        ctx = self.receiver
        assert ctx is not None
        while self._next < len(self.buckets):
            try:
                if not self._work.is_completed():
                    time.sleep(0.0005)
                    return False
                self._work.wait()
            except Exception as e:
                raise TransportError(f"rank0: broadcast of bucket {self._next} from trainer rank 0 failed: {e}") from e
            k = self._next
            self._next += 1
            if self._next < len(self.buckets):
                self._post(self._next)
            buf = self.bufs[k % len(self.bufs)]
            params = {p[0]: p for p in self.buckets[k]["params"]}
            for it in self._items[k]:
                full = self._full(buf, params[it.transfer.src_param])
                _write(ctx.landing.view(it.transfer.dst_tensor), it, full[box_slices(it.transfer.src_box)])
        return True

    def _missing(self) -> dict[int, str]:
        left = len(self.buckets) - self._next
        return {0: f"{left} of {len(self.buckets)} broadcast buckets missing"} if left else {}

    def _end_receive(self) -> None:
        if self._next < len(self.buckets):
            self._broken = True
        self._work = None
