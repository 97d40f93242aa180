"""Delta streams along relay chains: ``WeightSync(delta=True)`` on plans with relays.

With relays the trainer ranks write only the chain's root replica (plus the transfers planned
direct to every replica, ``Fanout.direct``). For a dense version an engine rank forwards the bytes
that landed (``relay.py``); for a delta version nothing lands in the tensors before the flip,
so it forwards the *streams*: each trainer rank's delta stream into the root rank, whole, as it
arrived. Every rank down the chain holds one relay inbox per origin trainer rank (the size of the
root's inbox from it) and applies the records of the transfers that reach it by relay (the root
copies' indices, as dense relays count them: ``executor/relay.py``), skipping those it gets
directly. Replicas of one chain hold the same version, so one stream fits all of them; where one
does not, the trainer rank sends that chain's links dense (base -1), as for any engine rank that
does not hold the base.

Per (child, origin trainer rank) a rank prepares one WRITE per page, from where that origin's
stream lies here (the root: its inbox from that trainer rank; further down: its relay inbox) to the
child's relay inbox at the same offsets. A version:

* the child arms (``armed_key``: its agent name, so a parent reconnects to a renewed endpoint);
* once an origin's stream is complete here, the pages that hold it are posted (its length read from
  the stream's header, bounded by the inbox; the child checks the stream again before applying),
  each followed by ``fdr|version|origin|page|pages|mac``;
* the child counts pages only from the agent its upstream rank announced (``delta_relay_key``), with
  a good MAC, for the open version. Missing pages are reported as ``engine rank X (relay)``.

A rank is complete when its own streams arrived and every forward it posted finished (or failed:
a dead child does not fail its parent; the child's own deadline names the relay).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

from fastsync.errors import TransportError
from fastsync.protocol import delta_relay_key, nixl_meta_key, relay_inbox_key
from fastsync.executor.delta import HEADER_BYTES
import fastsync.transport.nixl.notes as notes
from fastsync.transport.nixl.chain import ChainHop
from fastsync.transport.nixl.delta import page_bytes
from fastsync.transport.nixl.teardown import release
from fastsync.transport.nixl.writes import PreparedWrite, mem_of

__all__ = ["DeltaRelay", "stream_bytes"]




def stream_bytes(buf: torch.Tensor) -> int:
    """A stream's length from its header, bounded by the buffer holding it."""
    n = int(buf[:HEADER_BYTES].view(torch.int64)[4]) if buf.numel() >= HEADER_BYTES else 0
    return max(HEADER_BYTES, min(n, buf.numel()))


class DeltaRelay(ChainHop):
    """Delta relay duties of one engine rank. ``sources``: origin -> the buffer its stream lies in
    here (what this rank forwards); ``relay_inboxes``: origin -> where the upstream rank writes it
    (empty at a chain's root). ``transport``: the rank's
    :class:`~fastsync.transport.nixl.NixlTransport` (its current agent: renewed after an
    incomplete version)."""

    kind = "fdr"

    def __init__(self, transport: Any, rank: int, prog: Any, sources: dict[int, torch.Tensor],
                 relay_inboxes: dict[int, torch.Tensor], control: Any, timeout_s: float, *, key: bytes,
                 refuse: Callable[[str, str, bytes], None]) -> None:
        super().__init__(control, rank, prog.upstream, timeout_s, key=key, refuse=refuse)
        self._tr, self.prog = transport, prog
        self.sources, self.relay_inboxes = sources, relay_inboxes
        addrs = {str(s): [b.data_ptr(), b.numel(), *mem_of(b)] for s, b in relay_inboxes.items()}
        control.set(relay_inbox_key(rank), json.dumps(addrs))
        self._agent: Any = None  # the agent the handles below were prepared on
        self._handles: dict[tuple[int, int], list[PreparedWrite]] = {}  # (child, origin) -> one per page
        self._page: dict[tuple[int, int], int] = {}
        self._version: int | None = None
        self._got: dict[int, set[int]] = {}
        self._expect: dict[int, int | None] = {}
        self.forwarded: dict[int, int] = {}  # child -> stream bytes posted to it in the open version

    @property
    def agent(self) -> Any:
        return self._tr.agent

    def _writes(self) -> Iterable[PreparedWrite]:
        return [w for ws in self._handles.values() for w in ws]

    def _announce_key(self, upstream: int, child: int) -> str:
        return delta_relay_key(upstream, child)

    def _my_agent(self) -> str:
        return self._tr.agent_name

    def _prepare(self) -> None:
        """Page writes to every child, on the current agent (again after it was renewed)."""
        self._agent, self._handles, self._remote = self.agent, {}, {}
        for child, by_origin in sorted(self.prog.children.items()):
            what = f"engine rank {child} (delta relay target of engine rank {self.rank})"
            meta = self.control.get(nixl_meta_key(child), self.timeout_s, what=what)
            inbox = json.loads(self.control.get(relay_inbox_key(child), self.timeout_s, what=what))
            self.control.set(delta_relay_key(self.rank, child), json.dumps({"agent": self._tr.agent_name}))
            try:
                self._remote[child] = self.agent.add_remote_agent(meta)
            except Exception as e:
                raise TransportError(f"nixl: engine rank {self.rank} cannot add engine rank {child}'s agent: {e}") from e
            for origin in sorted(by_origin):
                src = self.sources[origin]
                ptr, size, rmem, rdev = inbox[str(origin)]
                if size != src.numel():
                    raise TransportError(f"engine rank {child}'s relay inbox for trainer rank {origin} holds {size} "
                                         f"bytes, engine rank {self.rank}'s stream {src.numel()}: the two sides "
                                         "disagree on the plan")
                page = page_bytes(size)
                lmem, ldev = mem_of(src)
                handles = []
                for off in range(0, size, page):
                    n = min(page, size - off)
                    ldesc = self.agent.get_xfer_descs(np.array([(src.data_ptr() + off, n, ldev)], dtype=np.uint64), lmem)
                    rdesc = self.agent.get_xfer_descs(np.array([(ptr + off, n, rdev)], dtype=np.uint64), rmem)
                    handles.append(PreparedWrite(self.agent, ldesc, rdesc, self._remote[child], child,
                                                 what=f"of delta relays from engine rank {self.rank} to {child}"))
                self._handles[(child, origin)] = handles
                self._page[(child, origin)] = page

    # ---- one version ----------------------------------------------------------------------
    def begin(self, version: int) -> None:
        if self.prog.children and self._agent is not self.agent:
            self._prepare()  # first version, or this rank's agent was renewed: nothing old to settle
            self._unsettled = False
        self._open(version)
        self._version, self.forwarded = version, {}
        self._got = {s: set() for s in self.relay_inboxes}
        self._expect = {s: None for s in self.relay_inboxes}

    def on_message(self, agent: str, raw: bytes) -> bool:
        """Take a ``fdr`` notification (True when it was one; counted only from the upstream
        rank's announced agent, with a good MAC, for the open version and a known origin)."""
        note = self._note(agent, raw, self._version, "delta relay")
        if not isinstance(note, notes.Note):
            return note
        if note.src not in self._got:
            self._refuse(f"no delta relay of trainer rank {note.src}'s stream into this rank", agent, raw)
        elif not 0 <= note.a < note.b or self._expect[note.src] not in (None, note.b):
            self._refuse(f"delta relay page {note.a} of {note.b}", agent, raw)
        else:
            self._got[note.src].add(note.a)
            self._expect[note.src] = note.b
        return True

    def complete(self) -> set[int]:
        """Origins whose relayed stream fully arrived here."""
        return {s for s, m in self._expect.items() if m is not None and len(self._got[s]) >= m}

    def pump(self, ready: set[int]) -> None:
        """Post the pages of every origin stream complete here (``ready``) to every armed child."""
        v = self._version
        for (child, origin), handles in self._handles.items():
            if (child, origin) in self._posted or child in self.failed or origin not in ready:
                continue
            armed = self._child_armed(child, v)
            if armed is None:
                return  # cut off from the store: again at the next poll, within the deadline
            if not armed:
                continue
            nbytes = stream_bytes(self.sources[origin])
            m = -(-nbytes // self._page[(child, origin)])
            writes = [(handles[k], notes.encode(self._key, "fdr", sender_agent=self._tr.agent_name, dst=child,
                                                version=v, src=origin, a=k, b=m)) for k in range(m)]
            self._post(child, origin, writes, f"trainer rank {origin}'s delta stream")
            self.forwarded[child] = self.forwarded.get(child, 0) + nbytes

    def incoming_done(self) -> bool:
        return len(self.complete()) == len(self._expect)

    def forwards_done(self) -> bool:
        return super().forwards_done() and all(k in self._posted for k in self._handles if k[0] not in self.failed)

    def missing(self) -> dict[str, str]:
        out: dict[str, str] = {}
        left = sorted(set(self._expect) - self.complete())
        if left:
            out[f"engine rank {self.upstream} (relay)"] = f"delta streams of trainer ranks {left} not relayed"
        for child in sorted(self.prog.children):
            if child not in self.failed and any(k[0] == child and k not in self._posted for k in self._handles):
                out[f"relay to engine rank {child}"] = "delta streams not forwarded yet"
        return out

    def close(self) -> None:
        if self._agent is not None and self._agent is self.agent:
            release(self.agent, (w.handle for w in self._writes()), remotes=self._remote.values())
        self._handles.clear()
        self._remote.clear()
