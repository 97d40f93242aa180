"""The sending side of the ``nixl`` transport (a trainer rank): one prepared WRITE per (chunk,
engine rank) over descriptor lists computed once from the static program, what it writes to each
receiver announced on the control plane, and per version the chunks packed, posted with a signed
notification and drained under the deadline; after a failed version the handles are settled (and
broken peers reconnected) before any is posted again. Part of
:class:`~fastsync.transport.nixl.transport.NixlTransport`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable

import numpy as np

from fastsync.errors import SyncError, TransportError
from fastsync.executor.metrics import SyncMetrics
from fastsync.executor.pipeline import run_pipelined
from fastsync.executor.program import Chunk
from fastsync.executor.staging import wait_device
from fastsync.executor.verify import Digests
from fastsync.protocol import batches_key, nixl_addrs_key, nixl_meta_key, nixl_send_key
import fastsync.transport.nixl.notes as notes
from fastsync.transport.base import SenderContext
from fastsync.transport.nixl.teardown import quiesce
from fastsync.transport.nixl.writes import PreparedWrite, mem_of, reconnect_peer, settle

__all__ = ["NixlSending"]

log = logging.getLogger("fastsync.transport.nixl")

#: Sender's wait for its posted writes: first check after 0.2 ms, then backing off to 2 ms.
_DRAIN_SLEEP_S, _DRAIN_SLEEP_MAX_S = 0.0002, 0.002


class NixlSending:
    """The sender's half of :class:`~fastsync.transport.nixl.transport.NixlTransport` (its
    agent, registration and state are the transport's)."""

    @property
    def remote_agents(self) -> dict[int, str]:
        """The NIXL agent name of each engine rank this sender writes to (after ``setup_sender``)."""
        return self._remote

    def _setup_sender(self, ctx: SenderContext) -> None:
        self._new_agent("send", ctx.rank, ctx.control)
        prog = ctx.program
        bufs = [ctx.packer.staging] if prog.staging_bytes else []
        direct_params = sorted({it.transfer.src_param for c in prog.chunks for it in c.items if it.direct})
        bufs += [ctx.sources[p].reshape(-1) for p in direct_params]
        self._register(bufs, f"trainer rank {ctx.rank}")
        dsts = sorted({d for c in prog.chunks for d in c.dst_ranks()})
        addrs: dict[int, dict] = {}
        for d in dsts:
            meta = ctx.control.get(nixl_meta_key(d), ctx.timeout_s, what=f"engine rank {d}")
            addrs[d] = json.loads(ctx.control.get(nixl_addrs_key(d), ctx.timeout_s, what=f"engine rank {d}"))
            try:
                self._remote[d] = self.agent.add_remote_agent(meta)
            except Exception as e:
                raise TransportError(f"nixl: trainer rank {ctx.rank} cannot add engine rank {d}'s agent: {e}") from e
        counts: dict[int, int] = {}
        batches: dict[int, list[list[list[int]]]] = {}  # dst -> write batch k -> [flat index, offset, bytes]
        for c in prog.chunks:
            local: dict[int, list] = {}
            remote: dict[int, list] = {}
            segs: dict[int, list[list[int]]] = {}
            lmem = "DRAM"
            for it in c.items:
                d, name = it.transfer.dst_rank, it.transfer.dst_tensor
                base, size, mem, dev = addrs[d][name]
                for view, off in ctx.packer.segment_views(it):
                    n = view.numel()
                    if off + n > size:
                        raise TransportError(
                            f"nixl: engine rank {d} registered {size} bytes for {name!r}, plan writes up to {off + n}"
                        )
                    lmem, ldev = mem_of(view)
                    local.setdefault(d, []).append((view.data_ptr(), n, ldev))
                    remote.setdefault(d, []).append((base + off, n, dev))
                    segs.setdefault(d, []).append([it.index, off, n])
            entries = []
            for d in sorted(local):
                ldesc = self.agent.get_xfer_descs(np.array(local[d], dtype=np.uint64), lmem)
                rdesc = self.agent.get_xfer_descs(np.array(remote[d], dtype=np.uint64), addrs[d][next(iter(addrs[d]))][2])
                w = PreparedWrite(self.agent, ldesc, rdesc, self._remote[d], d,
                                  what=f"from trainer rank {ctx.rank} to engine rank {d}")
                entries.append((d, w, counts.get(d, 0)))
                counts[d] = counts.get(d, 0) + 1
                batches.setdefault(d, []).append(segs[d])
            self._handles[c.index] = entries
        self._num_posts = counts
        sent = prog.bytes_per_dst()
        for d in dsts:  # what the receivers check every notification against
            ctx.control.set(nixl_send_key(ctx.rank, d), json.dumps(
                {"agent": self.agent_name, "posts": counts.get(d, 0), "bytes": sent.get(d, 0)}))
        if ctx.plan.has_relays:  # relaying engine ranks forward batch by batch: say which bytes each wrote
            for d, rows in batches.items():
                ctx.control.set(batches_key(ctx.rank, d), json.dumps(rows))
        for d in dsts:
            try:
                self.agent.make_connection(self._remote[d])
            except Exception:  # optional warm-up; the first transfer connects anyway
                pass

    def _send(self, version: int, deadline: float, metrics: SyncMetrics, crcs: Digests | None,
              on_chunk: Callable[[int], None] | None) -> None:
        ctx = self.sender
        assert ctx is not None
        rank = ctx.rank

        def pack(c: Chunk) -> None:
            ctx.packer.pack(c, crcs)
            wait_device(ctx.packer.staging)  # NIXL reads VRAM on its own streams: packing must be done

        moving: list = []  # handles posted and not yet seen done: what ``progress`` drives

        def progress() -> None:
            # Over TCP, UCX sends a posted write's bytes only while this process drives it: without
            # this the chunk already posted stalls while the next one packs. Any state check
            # progresses the worker; errors are left for drain to report with their ranks.
            while moving:
                try:
                    if self.agent.check_xfer_state(moving[0]) != "DONE":
                        return
                except Exception:
                    return
                moving.pop(0)

        def post(c: Chunk) -> None:
            moving.extend(w.handle for _, w, _ in self._handles[c.index])
            for d, w, k in self._handles[c.index]:
                n = self._num_posts[d]
                msg = notes.encode(self._key, "fs", sender_agent=self.agent_name, dst=d, version=version, src=rank, a=k, b=n)
                if w.post(msg) == "ERR":
                    self._broken.add(d)
                    raise TransportError(
                        f"nixl: trainer rank {rank} failed to post writes to engine rank {d} "
                        f"({_tensors(c, d)})"
                    )

        def drain(c: Chunk, dl: float) -> None:
            for d, w, _ in self._handles[c.index]:
                h = w.handle
                nap = _DRAIN_SLEEP_S
                while True:
                    try:
                        state = self.agent.check_xfer_state(h)
                    except Exception as e:  # e.g. NIXL_ERR_REMOTE_DISCONNECT: the connection broke
                        self._broken.add(d)
                        raise TransportError(f"nixl: writes from trainer rank {rank} to engine rank {d} failed: "
                                             f"{type(e).__name__}: {e} ({_tensors(c, d)})") from e
                    if state == "DONE":
                        break
                    if state == "ERR":
                        self._broken.add(d)
                        raise TransportError(
                            f"nixl: writes from trainer rank {rank} to engine rank {d} failed ({_tensors(c, d)})"
                        )
                    if time.monotonic() >= dl:
                        raise SyncError(
                            f"nixl: writes from trainer rank {rank} to engine rank {d} not done by the deadline "
                            f"({_tensors(c, d)})"
                        )
                    time.sleep(nap)  # back off: a spinning sender takes the cores TCP needs to move its bytes
                    nap = min(nap * 2, _DRAIN_SLEEP_MAX_S)

        wait_device(ctx.packer.staging)  # the sources' pending updates (staging shares their device)
        if self._unsettled:  # the last version failed: no handle may be reposted while still in flight
            self._settle()
        try:
            run_pipelined(ctx.program.chunks, pack=pack, post=post, drain=drain, deadline=deadline,
                          metrics=metrics, overlap=self.overlap, on_chunk=on_chunk, in_flight=self.in_flight,
                          progress=progress, on_posted=self.posted_hook)
        except BaseException:
            # Let writes already posted finish (bounded) before the failure is reported, so none
            # lands after the receivers rolled back; what is still in flight then is settled
            # before the next version posts (nixl_writes.settle).
            self._quiesce(min(deadline, time.monotonic() + 5.0))
            self._unsettled = True
            raise

    def _writes(self) -> list[PreparedWrite]:
        return [w for entries in self._handles.values() for _, w, _ in entries]

    def _settle(self) -> None:
        """Before posting after a failed version: replace handles still in flight, reconnect
        engine ranks whose connection broke (their agent metadata read again from the store)."""
        ctx = self.sender
        assert ctx is not None
        self.settled = settle(self._writes(), self.reconnect, self._broken)
        if self.settled["renewed"] or self.settled["reconnected"]:
            log.info("nixl: trainer rank %d: %d write handle(s) renewed, %d engine rank(s) reconnected after a "
                     "failed version", ctx.rank, self.settled["renewed"], self.settled["reconnected"])
        self._broken.clear()
        self._unsettled = False

    def reconnect(self, d: int) -> str:
        """Forget engine rank ``d``'s agent and add it again from the metadata it published (its
        connection broke, or it renewed its endpoint); every write to it is prepared afresh.
        Returns the remote name."""
        ctx = self.sender
        assert ctx is not None
        self._remote[d] = reconnect_peer(
            self.agent, self._writes(), d, self._remote.get(d),
            lambda: ctx.control.get(nixl_meta_key(d), ctx.timeout_s, what=f"engine rank {d}"),
            f"trainer rank {ctx.rank}")
        self.remote_gen[d] = self.remote_gen.get(d, 0) + 1
        return self._remote[d]

    def expect_endpoints(self, endpoints: dict[int, str]) -> None:
        for d, name in endpoints.items():
            if name and d in self._remote and self._remote[d] != name:
                log.info("nixl: trainer rank %s: engine rank %d listens on a new agent (%s): reconnecting",
                         self.sender.rank if self.sender else "?", d, name)
                self.reconnect(d)
                self._broken.discard(d)

    def _quiesce(self, deadline: float) -> None:
        quiesce(self.agent, (w.handle for w in self._writes()), deadline)


def _tensors(c: Chunk, d: int, limit: int = 4) -> str:
    names = sorted({it.transfer.dst_tensor for it in c.items if it.transfer.dst_rank == d})
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return "tensors " + ", ".join(repr(n) for n in names[:limit]) + more
