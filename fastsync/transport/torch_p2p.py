"""``torch`` transport: point-to-point ``isend``/``irecv`` through torch.distributed (gloo on CPU,
NCCL on GPU), same plan and staging as ``nixl``, for machines without NIXL.

Two-sided, so the receiver must know every message in advance: at set-up each sender publishes,
per receiver, the list of messages it will send in order (destination tensor, byte offset,
length); the receiver posts matching ``irecv`` calls straight into its landing regions at
``begin_receive``. Messages between one pair are matched in order (same tag).

Limitation: a receive that never completes (a trainer died) cannot be cancelled in gloo; after
such a failure the process group should be rebuilt before the next sync over this transport.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import torch

from fastsync.errors import TransportError
from fastsync.protocol import torch_send_key
from fastsync.executor.metrics import SyncMetrics
from fastsync.executor.verify import Digests
from fastsync.executor.pipeline import run_pipelined
from fastsync.executor.program import Chunk
from fastsync.transport._dist import WorkWaiter, ensure_world, wait_work
from fastsync.transport.base import ReceiverContext, SenderContext, Transport

__all__ = ["TorchP2PTransport"]


class TorchP2PTransport(Transport):
    """``backend``: torch.distributed backend (``gloo`` on CPU). ``overlap``: pack the next chunk
    on a helper thread while the current chunk's sends are in flight."""

    name = "torch"

    def __init__(self, backend: str = "gloo", overlap: bool = True) -> None:
        super().__init__()
        self.backend = backend
        self.overlap = overlap
        self._msgs: dict[int, list[tuple[int, torch.Tensor]]] = {}  # chunk -> [(dst global, view)]
        self._recv: dict[int, list[torch.Tensor]] = {}  # src -> landing views, in order
        self._waiter: WorkWaiter | None = None
        self._pending: dict[int, list[Any]] = {}
        self._broken = ""

    # ---- sender -------------------------------------------------------------------------
    def _setup_sender(self, ctx: SenderContext) -> None:
        per_dst: dict[int, list[list]] = {}
        for c in ctx.program.chunks:
            msgs = []
            for it in c.items:
                d = it.transfer.dst_rank
                for view, off in ctx.packer.segment_views(it):
                    msgs.append((ctx.world.receiver(d), view))
                    per_dst.setdefault(d, []).append([it.transfer.dst_tensor, off, view.numel()])
            self._msgs[c.index] = msgs
        for d in range(ctx.world.num_receivers):
            ctx.control.set(torch_send_key(ctx.rank, d), json.dumps(per_dst.get(d, [])))
        ensure_world(ctx.control, ctx.world.trainer(ctx.rank), ctx.world.size, ctx.timeout_s, self.backend)

    def _send(self, version: int, deadline: float, metrics: SyncMetrics, crcs: Digests | None,
              on_chunk: Callable[[int], None] | None) -> None:
        import torch.distributed as dist

        ctx = self.sender
        assert ctx is not None

        def pack(c: Chunk) -> None:
            ctx.packer.pack(c, crcs)

        def post(c: Chunk) -> None:
            self._pending[c.index] = [(d, dist.isend(view, dst=d)) for d, view in self._msgs[c.index]]

        def drain(c: Chunk, dl: float) -> None:
            for d, w in self._pending.pop(c.index, []):
                wait_work(w, dl, f"torch: send from trainer rank {ctx.rank} to engine rank {d - ctx.world.num_trainers}")

        run_pipelined(ctx.program.chunks, pack=pack, post=post, drain=drain, deadline=deadline,
                      metrics=metrics, overlap=self.overlap, on_chunk=on_chunk)

    # ---- receiver -----------------------------------------------------------------------
    def _setup_receiver(self, ctx: ReceiverContext) -> None:
        ensure_world(ctx.control, ctx.world.receiver(ctx.rank), ctx.world.size, ctx.timeout_s, self.backend)
        for s, items in ctx.program.by_src.items():
            raw = ctx.control.get(torch_send_key(s, ctx.rank), ctx.timeout_s, what=f"trainer rank {s}")
            views = []
            total = 0
            for name, off, n in json.loads(raw):
                region = ctx.landing.regions.get(name)
                if region is None or off + n > region.numel():
                    raise TransportError(f"torch: trainer rank {s} would write {name!r}[{off}:{off + n}] on inference "
                                         f"rank {ctx.rank}, which holds {None if region is None else region.numel()} bytes")
                views.append(region[off: off + n])
                total += n
            want = sum(it.transfer.nbytes for it in items)
            if total != want:
                raise TransportError(f"torch: trainer rank {s} sends {total} bytes to engine rank {ctx.rank}, "
                                     f"the plan says {want}")
            self._recv[s] = views

    def _begin_receive(self, version: int) -> None:
        import torch.distributed as dist

        assert self.receiver is not None
        if self._broken:
            raise TransportError(self._broken)
        world = self.receiver.world
        works = [(s, dist.irecv(v, src=world.trainer(s))) for s, views in self._recv.items() for v in views]
        rank = self.receiver.rank
        self._waiter = WorkWaiter(works, time.monotonic() + self.receiver.timeout_s,
                                  lambda s: f"torch: receive on engine rank {rank} from trainer rank {s}")

    def _poll_receive(self) -> bool:
        assert self._waiter is not None
        done = self._waiter.done()
        if not done:
            time.sleep(0.0005)
        return done

    def _missing(self) -> dict[int, str]:
        if self._waiter is None:
            return {}
        return {s: f"{n} of {len(self._recv[s])} messages missing" for s, n in self._waiter.remaining.items() if n}

    def _end_receive(self) -> None:
        left = sum(self._waiter.remaining.values()) if self._waiter is not None else 0
        self._waiter = None
        if left:
            self._broken = (f"torch: {left} receives were left pending by a failed sync (gloo cannot cancel them); "
                            "rebuild the process group before using this transport again")
