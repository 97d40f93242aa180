"""Engine-rank relays over NIXL: forward what landed to the same rank of the next replica.

Used by :class:`~fastsync.transport.nixl.NixlTransport` on engine ranks whose receive program has
a relay part (``executor/relay.py``). Units: each trainer rank publishes, per destination, which
transfers each of its write batches carries (``nixl/send/{rank}/batches/{dst}``); every rank of a
chain reads those of the chain's root rank and cuts its relayed transfers into the same units, one
per (origin trainer rank, batch completing the transfer), so parent and child agree on them. Set-up
prepares one WRITE per (child, unit) from this rank's registered landing regions to the child's,
at the same byte offsets (replicas hold identical tensors). Per version:

* the child announces it is armed (``nixl/recv/{child}/armed/{version}``) when it begins;
* a unit is forwarded once it is complete here: every trainer batch its transfers touch arrived
  (a trainer-fed rank), or the same unit arrived from upstream (a relayed rank). The notification
  ``fr|version|rank|unit|n|mac`` follows the bytes, so forwarding pipelines with the trainers' writes;
  the child counts it only from the agent its upstream rank announced on the authenticated control
  plane, with a good MAC (job-secret key, as for trainer notifications) and the open version;
* the child counts units from its upstream engine rank as it counts trainer batches; missing
  units are reported as ``engine rank X (relay)``, so a dead relay fails the version by name;
* this rank is complete when its own bytes landed and every forward it posted finished (or failed:
  a dead child does not fail its parent; the child's own downstream ranks report it).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from fastsync.errors import TransportError
import fastsync.transport.nixl.notes as notes
from fastsync.protocol import armed_key, batches_key, nixl_addrs_key, nixl_meta_key, relay_key
from fastsync.transport.nixl.chain import ChainHop
from fastsync.transport.nixl.teardown import release
from fastsync.transport.nixl.writes import PreparedWrite

__all__ = ["NixlRelay"]


#: Forwards a relaying rank keeps in flight per child. Over TCP a unit's notification queues behind
#: every forward posted before it on the same connection, so posting all landed units at once held
#: each hop's notifications behind tens of MB (a chained reload at 0.1 Gb/s: 4.2 s per hop); NIXL
#: sends a forward's notification when its check finds it done, which every poll does.
FORWARDS_IN_FLIGHT = 8


class NixlRelay(ChainHop):
    """Relay state of one engine rank; ``agent`` is the rank's NIXL agent (already registered)."""

    kind = "fr"

    def __init__(self, agent: Any, ctx: Any, prog: Any, mem_of: Callable[[Any], tuple[str, int]], *,
                 key: bytes, agent_name: str, refuse: Callable[[str, str, bytes], None]) -> None:
        super().__init__(ctx.control, ctx.rank, prog.upstream, ctx.timeout_s, key=key, refuse=refuse)
        self.agent, self.ctx, self.prog = agent, ctx, prog
        self._mem_of = mem_of
        self._agent_name = agent_name
        # units: (origin trainer rank, the trainer batch it waits for, {base transfer index: byte ranges})
        self.units: list[tuple[int, int, dict[int, list[tuple[int, int]]]]] = []
        self._handles: dict[tuple[int, int], PreparedWrite] = {}  # (child, unit) -> prepared WRITE
        self._version: int | None = None
        self._got: set[int] = set()
        self._expect: int | None = None
        self.forwarded_bytes = 0

    def _writes(self) -> Iterable[PreparedWrite]:
        return self._handles.values()

    def _announce_key(self, upstream: int, child: int) -> str:
        return relay_key(upstream, child)

    def _my_agent(self) -> str:
        return self._agent_name

    def _cut_units(self) -> None:
        """Units of this chain, one per trainer write batch into the root rank that carries bytes
        this chain relays, with the byte ranges that batch wrote (same on every rank of it): a
        transfer split over many batches (a large embedding) leaves piece by piece, as it lands."""
        ctx, prog = self.ctx, self.prog
        n = prog.num_transfers
        relayed: dict[int, set[int]] = {}
        for items in [prog.incoming] + list(prog.children.values()):
            for origin, its in items.items():
                relayed.setdefault(origin, set()).update(it.index % n for it in its)
        for origin in sorted(relayed):
            raw = ctx.control.get(batches_key(origin, prog.root_rank), ctx.timeout_s,
                                  what=f"trainer rank {origin} (write batches into engine rank {prog.root_rank})")
            covered: set[int] = set()
            for k, segs in enumerate(json.loads(raw)):
                members: dict[int, list[tuple[int, int]]] = {}
                for x, off, nb in segs:
                    if x % n in relayed[origin]:
                        members.setdefault(x % n, []).append((int(off), int(nb)))
                if members:
                    self.units.append((origin, k, members))
                    covered.update(members)
            for i in sorted(relayed[origin] - covered)[:1]:
                raise TransportError(f"nixl: trainer rank {origin} writes no batch carrying transfer {i} into "
                                     f"engine rank {prog.root_rank}, which engine rank {ctx.rank}'s chain relays")

    def setup(self) -> None:
        """Prepared at the first :meth:`begin`, not here: the units come from the trainer ranks'
        write batches and the children's addresses from their own set-up, and a host that sets up
        its engines one after another and its trainer ranks after them (``WeightSync`` with live
        engines) has neither yet."""
        self._prepared = False

    def _prepare(self) -> None:
        ctx, regions = self.ctx, self.ctx.landing.regions
        self._cut_units()
        n = self.prog.num_transfers
        for child, by_origin in sorted(self.prog.children.items()):
            what = f"engine rank {child} (relay target of engine rank {ctx.rank})"
            meta = ctx.control.get(nixl_meta_key(child), ctx.timeout_s, what=what)
            addrs = json.loads(ctx.control.get(nixl_addrs_key(child), ctx.timeout_s, what=what))
            # what the child checks every relay notification against (as receivers do for trainer ranks)
            ctx.control.set(relay_key(ctx.rank, child), json.dumps({"agent": self._agent_name, "units": len(self.units)}))
            try:
                self._remote[child] = self.agent.add_remote_agent(meta)
            except Exception as e:
                raise TransportError(f"nixl: engine rank {ctx.rank} cannot add engine rank {child}'s agent: {e}") from e
            sent: dict[int, int] = {}  # transfer -> bytes the units forward of it
            for u, (origin, _, members) in enumerate(self.units):
                local, remote = [], []
                lmem = rmem = "DRAM"
                for it in by_origin.get(origin, []):
                    i = it.index % n
                    if i not in members:
                        continue
                    name = it.transfer.dst_tensor
                    region = regions[name]
                    lmem, ldev = self._mem_of(region)
                    if name not in addrs:
                        raise TransportError(f"nixl: engine rank {child} has no tensor {name!r} that engine rank "
                                             f"{ctx.rank} must relay: replicas differ")
                    base, size, rmem, rdev = addrs[name]
                    for off, nb in members[i]:
                        if off < 0 or nb <= 0 or off + nb > size or off + nb > region.numel():
                            raise TransportError(f"nixl: relay of {name!r} from engine rank {ctx.rank} to {child} "
                                                 f"writes bytes {off}..{off + nb}, the tensors hold {size}")
                        local.append((region.data_ptr() + off, nb, ldev))
                        remote.append((base + off, nb, rdev))
                        sent[i] = sent.get(i, 0) + nb
                        self.forwarded_bytes += nb
                if not local:
                    raise TransportError(f"nixl: relay unit {u} of engine rank {ctx.rank} to {child} is empty")
                ldesc = self.agent.get_xfer_descs(np.array(local, dtype=np.uint64), lmem)
                rdesc = self.agent.get_xfer_descs(np.array(remote, dtype=np.uint64), rmem)
                self._handles[(child, u)] = PreparedWrite(self.agent, ldesc, rdesc, self._remote[child], child,
                                                          what=f"of relays from engine rank {ctx.rank} to {child}")
            for items in by_origin.values():  # the batches' ranges must add up to each relayed transfer
                for it in items:
                    if sent.get(it.index % n, 0) != it.transfer.nbytes:
                        raise TransportError(
                            f"nixl: engine rank {ctx.rank} would relay {sent.get(it.index % n, 0)} bytes of "
                            f"{it.transfer.dst_tensor!r} to {child}, the plan moves {it.transfer.nbytes}")

    # ---- one version ----------------------------------------------------------------------
    def begin(self, version: int) -> None:
        if not getattr(self, "_prepared", False):
            self._prepare()
            self._prepared = True
        self._open(version)
        self._version, self._got, self._expect = version, set(), None

    def on_message(self, agent: str, raw: bytes) -> bool:
        """Take a ``fr|version|src|unit|n|mac`` notification; True when it was a relay one (counted
        only from the upstream rank's agent, with a good MAC, for the open version)."""
        note = self._note(agent, raw, self._version, "relay")
        if not isinstance(note, notes.Note):
            return note
        unit, n = note.a, note.b
        if note.src != self.upstream:
            self._refuse(f"engine rank {note.src} does not relay into this rank", agent, raw)
        elif n != len(self.units) or n != int(self._upstream_info["units"]) or not 0 <= unit < n:
            self._refuse(f"relay unit {unit} of {n}, this chain has {len(self.units)}", agent, raw)
        else:
            self._got.add(unit)
            self._expect = n
        return True

    def pump(self, batches_landed: Callable[[int], Any]) -> None:
        """Post every forward whose unit is complete here and whose child is armed.
        ``batches_landed(origin)``: the write batches of that trainer rank that arrived here."""
        v = self._version
        total = len(self.units)
        landed: dict[int, Any] = {}
        busy: dict[int, int] = {}
        for child, _, _ in self._moving:
            busy[child] = busy.get(child, 0) + 1
        for (child, u), w in self._handles.items():
            if (child, u) in self._posted or child in self.failed or busy.get(child, 0) >= FORWARDS_IN_FLIGHT:
                continue
            origin, batch, _ = self.units[u]
            if self.prog.upstream is not None:
                ready = u in self._got
            else:
                if origin not in landed:
                    landed[origin] = batches_landed(origin)
                ready = batch in landed[origin]
            if not ready:
                continue
            armed = self._child_armed(child, v)
            if armed is None:
                return  # cut off from the store: try again at the next poll, within the deadline
            if not armed:
                continue
            msg = notes.encode(self._key, "fr", sender_agent=self._agent_name, dst=child, version=v, src=self.ctx.rank,
                               a=u, b=total)
            self._post(child, u, [(w, msg)], f"relay unit {u} (trainer rank {origin}'s bytes)")
            busy[child] = busy.get(child, 0) + 1

    def incoming_done(self) -> bool:
        return self.prog.upstream is None or (self._expect is not None and len(self._got) >= self._expect)

    def forwards_done(self) -> bool:
        """Every forward posted and finished (a failed one counts as finished, recorded in ``failed``)."""
        if not super().forwards_done():
            return False
        want = {k for k in self._handles if k[0] not in self.failed}
        return want <= set(self._posted)

    def missing(self) -> dict[str, str]:
        out: dict[str, str] = {}
        up = self.prog.upstream
        if up is not None and not self.incoming_done():
            left = [u for u in range(len(self.units)) if u not in self._got]
            origins = sorted({self.units[u][0] for u in left})
            out[f"engine rank {up} (relay)"] = (f"{len(left)} of {len(self.units)} relayed units missing "
                                                f"(bytes of trainer ranks {origins})")
        for child in sorted(self.prog.children):
            left = [u for (c, u) in self._handles if c == child and (c, u) not in self._posted]
            if left and child not in self.failed:
                out[f"relay to engine rank {child}"] = f"{len(left)} unit(s) not forwarded yet"
        return out

    def close(self) -> None:
        release(self.agent, (w.handle for w in self._handles.values()), remotes=self._remote.values())
        self._handles.clear()
        self._remote.clear()
