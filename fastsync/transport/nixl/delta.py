"""Variable-length one-sided writes over NIXL for delta streams (``fastsync.sync.delta``).

A delta stream's size changes every version, but NIXL handles are prepared once. So each
(sender, receiver) pair gets an outbox on the sender and an inbox of the same worst-case size on
the receiver (registered once; the inbox inside the receiver's landing buffers, so the agent
metadata the receiver publishes already covers it), cut into at most ``max_pages`` equal pages.
A handle per page is prepared at set-up; a sync posts the first ``m`` pages that hold the stream
with the notification ``fsd|version|src|k|m``, and a receiver has the stream when it holds all
``m`` notifications from that sender (sent after the bytes, as for dense writes).

The agent is the sync's own NIXL agent (``NixlTransport.agent``): one agent, one connection,
and the same trust rule as dense writes: a page notification ``fsd|version|src|k|m|mac`` counts
only if NIXL reports it from the agent that sender announced at set-up, with a MAC under the job's
notification key over (agent, receiver, version, sender, page, pages), for the open version;
anything else is refused and counted, and never completes a version.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from fastsync.control import ControlPlane, StoreUnreachable
from fastsync.errors import ConfigError, SyncError, TransportError
from fastsync.protocol import inbox_key, nixl_meta_key, nixl_send_key
import fastsync.transport.nixl.notes as notes
from fastsync.transport.nixl.teardown import quiesce, release
from fastsync.transport.nixl.writes import PreparedWrite, mem_of, rebind, settle

__all__ = ["DeltaOutbox", "DeltaInbox", "page_bytes"]

log = logging.getLogger("fastsync.transport.nixl.delta")

_MIN_PAGE = 64 << 10


def page_bytes(capacity: int, max_pages: int = 64) -> int:
    """Page size for an outbox/inbox of ``capacity`` bytes (a multiple of 64, >= 64 KiB)."""
    per = -(-capacity // max_pages)
    return max(_MIN_PAGE, -(-per // 64) * 64)




class DeltaOutbox:
    """Sender side: one registered outbox per receiver, page handles prepared once."""

    def __init__(self, agent: object, rank: int, outboxes: dict[int, torch.Tensor], remote_names: dict[int, str],
                 control: ControlPlane, timeout_s: float, page: int | None = None, *, key: bytes = b"",
                 agent_name: str = "", transport: Any = None) -> None:
        """``transport``: the dense :class:`~fastsync.transport.nixl.NixlTransport` whose agent and
        connections this outbox shares; when it reconnects an engine rank (``remote_gen``), the
        pages to that rank are prepared again before the next post."""
        if page is not None and (page <= 0 or page % 64):
            raise ConfigError(f"delta page_bytes must be a positive multiple of 64, got {page}")
        self.agent = agent
        self._tr = transport
        self._remote_names = remote_names
        self._gen: dict[int, int] = {}
        self.rank = rank
        self.outboxes = outboxes
        self._key = key
        self._agent_name = agent_name
        self._handles: dict[int, list[PreparedWrite]] = {}
        self._page: dict[int, int] = {}
        self._unsettled = False  # a failed version may have left pages in flight (nixl_writes.settle)
        self._broken: set[int] = set()
        bufs = [b for b in outboxes.values() if b.numel()]
        self._reg = None
        if bufs:
            mem = mem_of(bufs[0])[0]
            try:
                self._reg = agent.register_memory([(b.data_ptr(), b.numel(), mem_of(b)[1], "") for b in bufs], mem)
            except Exception as e:
                raise TransportError(f"nixl delta: trainer rank {rank}: registering outboxes failed: {e}") from e
        for d, box in outboxes.items():
            inbox = json.loads(control.get(inbox_key(d), timeout_s, what=f"engine rank {d} (delta inbox)"))
            ptr, size, rmem, rdev = inbox[str(rank)]
            if size != box.numel():
                raise TransportError(f"nixl delta: engine rank {d} holds a {size}-byte inbox for trainer rank {rank}, "
                                     f"whose outbox is {box.numel()} bytes: the two sides disagree on the plan")
            page = page_bytes(size) if page is None else page
            lmem, ldev = mem_of(box)
            handles = []
            for off in range(0, size, page):
                n = min(page, size - off)
                ldesc = agent.get_xfer_descs(np.array([(box.data_ptr() + off, n, ldev)], dtype=np.uint64), lmem)
                rdesc = agent.get_xfer_descs(np.array([(ptr + off, n, rdev)], dtype=np.uint64), rmem)
                handles.append(PreparedWrite(agent, ldesc, rdesc, remote_names[d], d,
                                             what=f"of delta pages from trainer rank {rank} to engine rank {d}"))
            self._handles[d] = handles
            self._page[d] = page

    def post(self, version: int, nbytes: dict[int, int], deadline: float,
             on_page: Callable[[int], None] | None = None) -> None:
        """Write the first ``nbytes[d]`` bytes of each outbox; returns when every write is done."""
        posted: list[tuple[int, object]] = []
        count = 0
        if self._unsettled:  # the last version failed: replace pages still in flight before reposting
            settle((w for ws in self._handles.values() for w in ws), self._reconnect_peer, self._broken)
            self._broken.clear()
            self._unsettled = False
        self._follow_reconnects()
        try:
            for d, n in nbytes.items():
                m = -(-n // self._page[d])
                for k in range(m):
                    if on_page is not None:
                        on_page(count)  # fault injection: called before each page is posted
                    count += 1
                    w = self._handles[d][k]
                    msg = notes.encode(self._key, "fsd", sender_agent=self._agent_name, dst=d, version=version,
                                       src=self.rank, a=k, b=m)
                    if w.post(msg) == "ERR":
                        self._broken.add(d)
                        raise TransportError(f"nixl delta: trainer rank {self.rank} failed to post to engine rank {d}")
                    posted.append((d, w.handle))
            for d, h in posted:
                while True:
                    state = self.agent.check_xfer_state(h)
                    if state == "DONE":
                        break
                    if state == "ERR":
                        raise TransportError(f"nixl delta: writes from trainer rank {self.rank} to engine rank {d} failed")
                    if time.monotonic() >= deadline:
                        raise SyncError(f"nixl delta: writes from trainer rank {self.rank} to engine rank {d} "
                                        "not done by the deadline")
                    time.sleep(0.0002)
        except BaseException:
            # let posted writes finish before the failure is reported; what is still in flight then
            # is settled before the next post
            quiesce(self.agent, (h for _, h in posted), min(deadline, time.monotonic() + 5.0))
            self._unsettled = True
            raise

    def _reconnect_peer(self, d: object) -> None:
        if self._tr is None:
            raise TransportError(f"nixl delta: trainer rank {self.rank}: the connection to engine rank {d} broke "
                                 "and this outbox cannot reconnect")
        self._tr.reconnect(int(d))  # type: ignore[arg-type]
        self._follow_reconnects()

    def _follow_reconnects(self) -> None:
        """Pages to an engine rank the dense transport connected afresh are prepared again."""
        if self._tr is None:
            return
        for d, ws in self._handles.items():
            gen = self._tr.remote_gen.get(d, 0)
            if self._gen.get(d, 0) != gen:
                rebind(ws, d, self._remote_names[d])
                self._gen[d] = gen

    def close(self) -> None:
        release(self.agent, (w.handle for ws in self._handles.values() for w in ws), self._reg)
        self._handles.clear()
        self._reg = None


class DeltaInbox:
    """Receiver side: publishes the inbox addresses, counts page notifications per sender."""

    def __init__(self, agent: object, rank: int, inboxes: dict[int, torch.Tensor], control: ControlPlane,
                 poll_sleep_s: float = 0.001, *, key: bytes = b"", transport: Any = None, relay: Any = None) -> None:
        """``relay``: this rank's :class:`~fastsync.transport.nixl.delta_relay.DeltaRelay` on plans
        with relays (its notifications are drained here too: one reader of the agent's queue)."""
        self._agent = agent
        self.relay = relay
        self._tr = transport  # when given, its current agent (renewed after an incomplete version)
        self._key = key
        self._control = control
        self._agents: dict[int, str] = {}
        self.refused: Counter = Counter()
        self.rank = rank
        self.inboxes = inboxes
        self.poll_sleep_s = poll_sleep_s
        addrs = {str(s): [b.data_ptr(), b.numel(), *mem_of(b)] for s, b in inboxes.items()}
        control.set(inbox_key(rank), json.dumps(addrs))
        self._got: dict[int, set[int]] = {}
        self._expect: dict[int, int | None] = {}
        self._version: int | None = None

    @property
    def agent(self) -> Any:
        return self._tr.agent if self._tr is not None else self._agent

    def begin(self, version: int) -> None:
        self._version = version
        self._got = {s: set() for s in self.inboxes}
        self._expect = {s: None for s in self.inboxes}
        if self.relay is not None:
            self.relay.begin(version)

    def _agent_of(self, src: int) -> str | None:
        """The agent trainer rank ``src`` announced at set-up (authenticated control plane)."""
        if src not in self._agents:
            try:
                raw = self._control.try_get(nixl_send_key(src, self.rank), timeout_s=1.0)
            except StoreUnreachable:
                return None  # cut off from the store for now
            if raw is None:
                return None
            self._agents[src] = str(json.loads(raw)["agent"])
        return self._agents[src]

    def _refuse(self, reason: str, agent: str, msg: bytes) -> None:
        self.refused[reason] += 1
        if self.refused[reason] <= 5:
            log.warning("nixl delta: engine rank %s refused a notification from agent %r (%s): %r",
                        self.rank, agent, reason, msg[:80])

    def poll(self) -> bool:
        for agent, msgs in self.agent.get_new_notifs().items():
            for msg in msgs:
                if self.relay is not None and self.relay.on_message(agent, msg):
                    continue
                try:
                    note = notes.decode(msg, "fsd")
                except ValueError:
                    self._refuse("malformed", agent, msg)
                    continue
                if note is None:
                    continue  # a dense write's notification (or not ours): the dense receiver's business
                v, src, k, m = note.version, note.src, note.a, note.b
                if src not in self._got:
                    self._refuse(f"trainer rank {src} sends nothing to this engine rank", agent, msg)
                    continue
                want = self._agent_of(src)
                if want != agent:
                    self._agents.pop(src, None)  # the sender may have restarted: read its set-up again
                    want = self._agent_of(src)
                if want != agent:
                    self._refuse(f"not trainer rank {src}'s agent", agent, msg)
                    continue
                if not notes.authentic(self._key, note, agent=agent, dst=self.rank):
                    self._refuse("bad MAC", agent, msg)
                    continue
                if v != self._version or not 0 <= k < m:
                    if v != self._version:
                        self._refuse("another version (late or replayed)", agent, msg)
                    else:
                        self._refuse(f"page {k} of {m}", agent, msg)
                    continue
                if self._expect[src] not in (None, m):
                    self._refuse(f"page count {m} after {self._expect[src]}", agent, msg)
                    continue
                self._got[src].add(k)
                self._expect[src] = m
        done = all(m is not None and len(self._got[s]) >= m for s, m in self._expect.items())
        if self.relay is not None:  # forward what is complete here; done when forwards finished too
            own = self.relay.complete() if self.relay.prog.upstream is not None else \
                {s for s, m in self._expect.items() if m is not None and len(self._got[s]) >= m}
            self.relay.pump(own)
            done = done and self.relay.incoming_done() and self.relay.forwards_done()
        if not done and self.poll_sleep_s:
            time.sleep(self.poll_sleep_s)
        return done

    def missing(self) -> dict[int, str]:
        out = notes.missing(self._expect, self._got, nothing="no delta page arrived", unit="delta pages")
        if self.relay is not None:
            out.update(self.relay.missing())
        return out
