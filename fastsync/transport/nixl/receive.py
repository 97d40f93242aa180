"""The receiving side of the ``nixl`` transport (an engine rank): its endpoint (an agent over the
landing memory, its addresses and metadata published; renewed after a version that did not
complete), what each sender announced at set-up, and the notifications of a version: each one
checked (from that sender's agent, for the open version, with its batch count and MAC) before it
counts, until every sender's batches are in. Part of :class:`~fastsync.transport.nixl.transport.NixlTransport`.
"""

from __future__ import annotations

import json
import logging
import time

from fastsync.control import StoreUnreachable
from fastsync.errors import TransportError
from fastsync.protocol import nixl_addrs_key, nixl_meta_key, nixl_send_key
import fastsync.transport.nixl.notes as notes
from fastsync.transport.base import ReceiverContext
from fastsync.transport.nixl.relay import NixlRelay
from fastsync.transport.nixl.teardown import release
from fastsync.transport.nixl.writes import mem_of

__all__ = ["NixlReceiving"]

log = logging.getLogger("fastsync.transport.nixl")

#: Bound on a control-plane read made while a receiver polls (it must keep driving UCX progress).
_READ_TIMEOUT_S = 1.0


class NixlReceiving:
    """The receiver's half of :class:`~fastsync.transport.nixl.transport.NixlTransport` (its
    agent, registration and state are the transport's)."""

    def _setup_receiver(self, ctx: ReceiverContext) -> None:
        self._control = ctx.control
        self._open_endpoint(ctx)

    def _open_endpoint(self, ctx: ReceiverContext) -> None:
        """A new agent over the landing memory: register it, publish addresses and metadata, and
        prepare this rank's relays."""
        self._new_agent("recv", ctx.rank, ctx.control)
        self._senders = {}
        self._register(ctx.landing.buffers(), f"engine rank {ctx.rank}")
        addrs = {}
        for name, region in ctx.landing.regions.items():
            mem, dev = mem_of(region)
            addrs[name] = [region.data_ptr(), region.numel(), mem, dev]
        ctx.control.set(nixl_addrs_key(ctx.rank), json.dumps(addrs))
        ctx.control.set(nixl_meta_key(ctx.rank), self.agent.get_agent_metadata())
        if ctx.program.relay is not None:  # this engine rank forwards to, or is fed by, other engine ranks
            self._relay = NixlRelay(self.agent, ctx, ctx.program.relay, mem_of, key=self._key,
                                    agent_name=self.agent_name, refuse=self._refuse)
            self._relay.setup()

    def endpoint(self) -> str:
        return self.agent_name

    def renew_endpoint(self) -> None:
        """After a version that did not complete: drop this rank's agent and open a fresh one.

        Writes of the failed version may still be in flight (a link that was cut holds them in
        TCP buffers and retransmits them when it returns). Over UCX's TCP transport a WRITE lands
        when this rank's worker reads it, so a late one could reach memory the next version has
        already written, over another connection, in any order. Destroying the agent closes its
        UCX worker and every connection it had: nothing of the failed version can land any more.
        The new agent registers the same memory; its name goes out with the next ``begun`` and
        trainer ranks (and an upstream relay, through ``armed``) reconnect before they write.
        """
        ctx = self.receiver
        assert ctx is not None
        if self._relay is not None:
            self._relay.close()
            self._relay = None
        release(self.agent, (), self._reg, ())
        self._reg = None
        self.agent = None  # the last reference: NIXL destroys the agent and its UCX worker here
        self._open_endpoint(ctx)
        self.renewals += 1
        self._renew_pending = False
        log.info("nixl: engine rank %d renewed its endpoint after an incomplete version (now %s)", ctx.rank,
                 self.agent_name)

    def _begin_receive(self, version: int) -> None:
        assert self.receiver is not None
        if self._renew_pending:
            self.renew_endpoint()
        self._got = {src: set() for src in self.receiver.program.by_src}
        self._begun_at, self._landed_at = time.monotonic(), None
        self._load_senders()
        self._expect = {src: (self._senders[src]["posts"] if src in self._senders else None)
                        for src in self.receiver.program.by_src}

        if self._relay is not None:
            self._relay.begin(version)

    def _load_senders(self) -> None:
        """What each sender of this receiver's plan published at set-up (agent name, batch and
        byte counts), read from the authenticated control plane; bytes checked against the plan."""
        assert self.receiver is not None and self._control is not None
        me = self.receiver.rank
        for src, items in self.receiver.program.by_src.items():
            if src in self._senders:
                continue
            try:
                raw = self._control.try_get(nixl_send_key(src, me), timeout_s=_READ_TIMEOUT_S)
            except StoreUnreachable:
                continue  # cut off from the store for now: read it again at its next notification
            if raw is None:
                continue  # not set up yet: its notifications cannot have been sent either
            info = json.loads(raw)
            want = sum(it.transfer.nbytes for it in items)
            if int(info["bytes"]) != want or int(info["posts"]) <= 0:
                raise TransportError(f"nixl: trainer rank {src} announced {info['bytes']} bytes in {info['posts']} "
                                     f"batch(es) for engine rank {me}, whose plan expects {want} bytes from it")
            self._senders[src] = {"agent": str(info["agent"]), "posts": int(info["posts"])}
            if self._receiving is not None:
                self._expect[src] = self._senders[src]["posts"]

    @property
    def notify_key(self) -> bytes:
        """The notification MAC key (from the job secret): the delta inbox and relays check with it."""
        return self._key

    def refuse(self, reason: str, agent: str, msg: bytes) -> None:
        """Drop a notification that is not authentic, once logged (what the delta paths call)."""
        self._refuse(reason, agent, msg)

    def _refuse(self, reason: str, agent: str, msg: bytes) -> None:
        self.refused[reason] += 1
        if self.refused[reason] <= 5:
            log.warning("nixl: engine rank %s refused a notification from agent %r (%s): %r",
                        self.receiver.rank if self.receiver else "?", agent, reason, msg[:80])

    def _poll_receive(self) -> bool:
        version = self._receiving
        me = self.receiver.rank if self.receiver else -1
        notifs = self.agent.get_new_notifs()
        for agent, msgs in notifs.items():
            for msg in msgs:
                if self._relay is not None and self._relay.on_message(agent, msg):
                    continue
                try:
                    note = notes.decode(msg, "fs")
                    if note is None:
                        raise ValueError("not a dense-batch notification")
                except ValueError:
                    self._refuse("malformed", agent, msg)
                    continue
                v, src, k, n = note.version, note.src, note.a, note.b
                if src not in self._got:
                    self._refuse(f"trainer rank {src} is not a sender of this receiver's plan", agent, msg)
                    continue
                info = self._senders.get(src)
                if info is None or agent != info["agent"]:
                    # not yet loaded, or the sender restarted with a new agent: read set-up again
                    self._senders.pop(src, None)
                    self._load_senders()
                    info = self._senders.get(src)
                if info is None or agent != info["agent"]:
                    self._refuse(f"not trainer rank {src}'s agent", agent, msg)
                    continue
                if not notes.authentic(self._key, note, agent=agent, dst=me):
                    self._refuse("bad MAC", agent, msg)
                    continue
                if v != version:
                    self._refuse("old version (late or replayed)" if v < (version or 0) else "unknown version",
                                 agent, msg)
                    continue
                if n != info["posts"] or not 0 <= k < n:
                    self._refuse(f"batch {k} of {n}, set-up announced {info['posts']}", agent, msg)
                    continue
                self._got[src].add(k)
        done = all(n is not None and len(self._got[s]) >= n for s, n in self._expect.items())
        if self._relay is not None:
            self._relay.pump(lambda src: self._got.get(src, ()))
            # every poll, not only once this rank's own bytes are in: NIXL sends a forward's
            # notification when its state is checked and found complete, so checking late held
            # every downstream replica until this one had landed (each hop store-and-forwarded all)
            forwarded = self._relay.forwards_done()
            landed = done and self._relay.incoming_done()
            done = landed and forwarded
        else:
            landed = done
        if landed and self._landed_at is None:
            self._landed_at = time.monotonic()
        if not done and self.poll_sleep_s:
            time.sleep(self.poll_sleep_s)
        return done

    @property
    def landed_s(self) -> float | None:
        """Seconds from this rank's last begin until every byte it holds had landed (a relaying
        rank may then still be forwarding); None before that."""
        landed, begun = self._landed_at, self._begun_at
        return None if landed is None or begun is None else landed - begun

    def _missing(self) -> dict[int | str, str]:
        out: dict[int | str, str] = notes.missing(self._expect, self._got, nothing="no write completed",
                                                  unit="write batches")
        if self._relay is not None:
            out.update(self._relay.missing())
        return out

    def _end_receive(self) -> None:
        complete = all(n is not None and len(self._got[s]) >= n for s, n in self._expect.items())
        if self._relay is not None:  # no relay may still read this rank's memory once the version closes
            complete = complete and self._relay.incoming_done()
            self._relay.quiesce(time.monotonic() + 5.0)
        if not complete:  # writes of this version may still be in flight: a fresh endpoint next time
            self._renew_pending = True

    def mark_incomplete(self) -> None:
        """A version another path (delta pages) received on this agent did not complete."""
        self._renew_pending = True

    def renew_if_pending(self) -> None:
        """:meth:`renew_endpoint` when the last version on this agent did not complete."""
        if self._renew_pending:
            self.renew_endpoint()
