"""``nixl`` transport: one-sided RDMA WRITEs through NVIDIA NIXL (UCX backend), DRAM or VRAM.

Set-up (once): each receiver creates an agent, registers its landing memory (one arena, plus
each in-place live tensor) and publishes its agent metadata and region addresses. Each sender
creates an agent, registers its staging arena (and the shard buffers it writes from directly),
adds the receivers' metadata, and prepares one transfer handle per (chunk, receiver) with
``initialize_xfer`` over descriptor lists computed from the static program. Per sync the handles
are re-posted with ``transfer(handle, notif)``; the notification ``fs|version|src|k|n|mac``
reaches the receiver after the write's bytes, and a receiver is complete when it holds batches
``0..n-1`` from every sending rank of its plan.

Trust: at set-up each sender publishes, on the authenticated control plane, its agent name and
how many batches and bytes it writes to each receiver; the receiver checks the bytes against its
own plan. A notification counts only if NIXL reports it from that sender's agent, for the open
version, with that batch count and a MAC (HMAC-SHA256 keyed by the job secret over agent, ranks,
version and batch). Anything else (another agent, an unknown or old version, a wrong count, a
bad MAC) is refused, counted in ``refused`` and logged; it never completes a version. UCX
listens only on ``net_devices`` (``$FASTSYNC_NET_DEVICES``, default ``lo``: loopback), set as
``UCX_NET_DEVICES`` before the agent is created.

Settings that matter on CPU hosts (measured, see shared notes): no progress thread
(``enable_prog_thread=False``: it spins a core per process), receivers poll notifications with a
short sleep rather than spinning.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from collections import Counter
from collections.abc import Callable

import numpy as np
import torch

from fastsync.control import StoreUnreachable
from fastsync.errors import ConfigError, SyncError, TransportError
from fastsync.executor.metrics import SyncMetrics
from fastsync.executor.verify import Digests
from fastsync.executor.pipeline import run_pipelined
from fastsync.executor.program import Chunk
from fastsync.executor.staging import wait_device
from fastsync.security import derive_key, loopback_mismatch, net_devices
import fastsync.transport.nixl.notes as notes
from fastsync.transport.base import ReceiverContext, SenderContext, Transport
from fastsync.protocol import batches_key, nixl_addrs_key, nixl_meta_key, nixl_send_key
from fastsync.transport.nixl.relay import NixlRelay
from fastsync.transport.nixl.teardown import quiesce, release
from fastsync.transport.nixl.writes import PreparedWrite, reconnect_peer, settle

try:
    from nixl._api import nixl_agent, nixl_agent_config

    IMPORT_ERROR: ImportError | None = None
except ImportError as _e:  # kept for a clear message when the transport is asked for
    nixl_agent = nixl_agent_config = None  # type: ignore[assignment]
    IMPORT_ERROR = _e

__all__ = ["NixlTransport", "IMPORT_ERROR", "warm_up"]

log = logging.getLogger("fastsync.transport.nixl")

INSTALL_HINT = "pip install nixl-cu12==1.5.1 && pip install --no-deps nixl==1.5.1"
#: Bound on a control-plane read made while a receiver polls (it must keep driving UCX progress).
_READ_TIMEOUT_S = 1.0
#: Sender's wait for its posted writes: first check after 0.2 ms, then backing off to 2 ms.
_DRAIN_SLEEP_S, _DRAIN_SLEEP_MAX_S = 0.0002, 0.002


_WARM: list = []  # the process's warm-up agent, kept alive: UCX stays initialised in this process


def warm_up(net_devices_: str | None = None) -> float:
    """Initialise NIXL/UCX in this process once (returns the seconds it took; 0.0 when already
    done or NIXL is absent). The first agent of a process costs ~0.4 s here (UCX loads and probes
    its transports), later ones ~0.02 s: an engine that will receive or send weights pays it at
    start (``fastsync_describe``), not inside its first transfer."""
    if _WARM or IMPORT_ERROR is not None:
        return 0.0
    os.environ["UCX_NET_DEVICES"] = net_devices(net_devices_)
    t0 = time.perf_counter()
    try:
        _WARM.append(nixl_agent(f"fastsync-warm-{os.getpid()}-{uuid.uuid4().hex[:6]}",
                                nixl_agent_config(enable_prog_thread=False, backends=["UCX"])))
    except Exception as e:  # the transfer's own agent will report it, naming the rank
        log.warning("nixl: warm-up agent failed: %s: %s", type(e).__name__, e)
        _WARM.append(None)
    return time.perf_counter() - t0


def poll_sleep_for(devices: str) -> float:
    """A receiver's sleep between notification polls. Where UCX moves data without the receiver
    (shared memory and CMA on one host, RDMA NICs: names like ``mlx5_0:1``) 1 ms costs nothing and
    spares the CPU. Over TCP (an Ethernet interface such as ``eth0``) the receiver's own progress
    reads the sockets: a 1 ms nap lets its socket buffers fill and stalls the senders (measured on
    the host rig, 2 Gb/s NICs: 0.70-0.74 s per sync at 1 ms, 0.67-0.69 s at 0.2 ms), so 0.2 ms."""
    names = [d.strip() for d in devices.split(",") if d.strip()]
    tcp = any(d != "lo" and ":" not in d for d in names)
    return 0.0002 if tcp else 0.001


def _mem(t: torch.Tensor) -> tuple[str, int]:
    return ("DRAM", 0) if t.device.type == "cpu" else ("VRAM", t.device.index or 0)


class NixlTransport(Transport):
    """NIXL one-sided WRITE transport (the default where NIXL imports).

    ``backends``: NIXL backends to create (UCX moves DRAM and VRAM). ``progress_thread``: NIXL's
    own progress thread (off by default: on a CPU host it costs a core per process).
    ``poll_sleep_s``: receiver sleep between notification polls (default: by ``net_devices``,
    :func:`poll_sleep_for`). ``overlap``: pack the next chunk
    on a helper thread while the current one is written. ``net_devices``: the UCX devices to
    listen and connect on (default ``$FASTSYNC_NET_DEVICES``, else ``lo``). ``in_flight``: write
    batches a sender keeps in flight (default 1; ``run_pipelined``).
    """

    name = "nixl"
    relays = True

    def __init__(self, backends: tuple[str, ...] = ("UCX",), progress_thread: bool = False,
                 poll_sleep_s: float | None = None, overlap: bool = True, net_devices: str | None = None,
                 in_flight: int = 1) -> None:
        super().__init__()
        if IMPORT_ERROR is not None:
            raise ConfigError(f"transport 'nixl' needs NIXL ({INSTALL_HINT}): {IMPORT_ERROR}")
        if poll_sleep_s is not None and poll_sleep_s < 0:
            raise ConfigError(f"poll_sleep_s must be >= 0, got {poll_sleep_s}")
        self.backends = list(backends)
        self.progress_thread = progress_thread
        self.poll_sleep_s = poll_sleep_s
        self.overlap = overlap
        if not isinstance(in_flight, int) or isinstance(in_flight, bool) or not 1 <= in_flight <= 64:
            raise ConfigError(f"nixl transport option in_flight must be an int in [1, 64], got {in_flight!r}")
        self.in_flight = in_flight
        self.net_devices = net_devices
        self.agent = None
        self.agent_name = ""
        self._reg = None
        self._handles: dict[int, list[tuple[int, PreparedWrite, int]]] = {}  # chunk -> [(dst, write, k)]
        self._unsettled = False  # a failed version may have left writes in flight (see nixl_writes.settle)
        self._broken: set[int] = set()  # engine ranks a post to failed
        self.settled: dict[str, int] = {}  # what the last settle() did (tests, logs)
        self.remote_gen: dict[int, int] = {}  # engine rank -> times reconnected (delta outboxes follow it)
        self._renew_pending = False  # receiver: the last version did not complete (see renew_endpoint)
        self.renewals = 0  # receiver: endpoints renewed after incomplete versions
        self._num_posts: dict[int, int] = {}
        self._remote: dict[int, str] = {}
        self._got: dict[int, set[int]] = {}
        self._begun_at: float | None = None  # this rank's last begin, and when its own bytes were all in
        self._landed_at: float | None = None
        self._expect: dict[int, int | None] = {}
        self._key = b""  # notification MAC key, from the job secret
        self._control = None
        self._senders: dict[int, dict] = {}  # receiver: src rank -> {"agent", "posts", "bytes"} from set-up
        self.refused: Counter[str] = Counter()  # receiver: notifications refused, by reason
        self._relay: NixlRelay | None = None
        self.registration: dict = {}
        self.agent_seconds = 0.0  # creating the agent (UCX context and workers), reported beside registration

    def _new_agent(self, role: str, rank: int, control: object) -> None:
        secret = getattr(control, "secret", None)
        if not secret:
            raise ConfigError(f"transport 'nixl' ({role} rank {rank}) needs the job secret on the control plane "
                              "(control.secret) to sign and check its notifications")
        self._key = derive_key(secret, "nixl notifications")
        # UCX reads its configuration when the agent's context is created: listen only here
        os.environ["UCX_NET_DEVICES"] = devices = net_devices(self.net_devices)
        if self.poll_sleep_s is None:
            self.poll_sleep_s = poll_sleep_for(devices)
        warning = loopback_mismatch(devices, getattr(control, "host", None))
        if warning:
            log.warning("nixl (%s rank %d): %s", role, rank, warning)
        name = f"fastsync-{role}{rank}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.agent_name = name
        conf = nixl_agent_config(enable_prog_thread=self.progress_thread, backends=self.backends)
        t0 = time.perf_counter()
        try:
            self.agent = nixl_agent(name, conf)
        except Exception as e:
            raise TransportError(f"nixl: cannot create agent for {role} rank {rank}: {e}") from e
        self.agent_seconds = time.perf_counter() - t0

    def _register(self, tensors: list[torch.Tensor], who: str) -> None:
        """Register the distinct storages behind ``tensors`` in one call (views of one buffer,
        e.g. shards packed in a flat parameter, register once)."""
        if not tensors:
            return
        seen: dict[int, tuple[int, int, int, str]] = {}
        mem = _mem(tensors[0])[0]
        for t in tensors:
            st = t.untyped_storage()
            if st.nbytes() and st.data_ptr() not in seen:
                seen[st.data_ptr()] = (st.data_ptr(), st.nbytes(), _mem(t)[1], "")
        if not seen:  # a rank whose plan gives it nothing to send or receive registers nothing
            return
        t0 = time.perf_counter()
        try:
            self._reg = self.agent.register_memory(list(seen.values()), mem)
        except Exception as e:
            raise TransportError(f"nixl: {who}: registering {len(seen)} buffer(s) failed: {e}") from e
        # reported by peer reload: how many regions one engine's weights took, and how long
        self.registration = {"regions": len(seen), "bytes": sum(v[1] for v in seen.values()),
                             "seconds": time.perf_counter() - t0, "agent_seconds": self.agent_seconds}

    # ---- receiver -----------------------------------------------------------------------
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
            mem, dev = _mem(region)
            addrs[name] = [region.data_ptr(), region.numel(), mem, dev]
        ctx.control.set(nixl_addrs_key(ctx.rank), json.dumps(addrs))
        ctx.control.set(nixl_meta_key(ctx.rank), self.agent.get_agent_metadata())
        if ctx.program.relay is not None:  # this engine rank forwards to, or is fed by, other engine ranks
            self._relay = NixlRelay(self.agent, ctx, ctx.program.relay, _mem, key=self._key,
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

    @property
    def remote_agents(self) -> dict[int, str]:
        """The NIXL agent name of each engine rank this sender writes to (after ``setup_sender``)."""
        return self._remote

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

    # ---- sender -------------------------------------------------------------------------
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
                    lmem, ldev = _mem(view)
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

    def _close(self) -> None:
        if self.agent is None:
            return
        if self._relay is not None:
            self._relay.close()
            self._relay = None
        release(self.agent, (w.handle for w in self._writes()), self._reg, self._remote.values())
        self._handles.clear()
        self._reg = None
        self._remote.clear()
        self.agent = None


def _tensors(c: Chunk, d: int, limit: int = 4) -> str:
    names = sorted({it.transfer.dst_tensor for it in c.items if it.transfer.dst_rank == d})
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return "tensors " + ", ".join(repr(n) for n in names[:limit]) + more
