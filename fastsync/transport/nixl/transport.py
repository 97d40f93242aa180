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

import logging
import os
import time
import uuid
from collections import Counter

import torch

from fastsync.errors import ConfigError, TransportError
from fastsync.security import derive_key, loopback_mismatch, net_devices
from fastsync.transport.base import Transport
from fastsync.transport.nixl.receive import NixlReceiving
from fastsync.transport.nixl.relay import NixlRelay
from fastsync.transport.nixl.send import NixlSending
from fastsync.transport.nixl.teardown import release
from fastsync.transport.nixl.writes import PreparedWrite, mem_of

try:
    from nixl._api import nixl_agent, nixl_agent_config

    IMPORT_ERROR: ImportError | None = None
except ImportError as _e:  # kept for a clear message when the transport is asked for
    nixl_agent = nixl_agent_config = None  # type: ignore[assignment]
    IMPORT_ERROR = _e

__all__ = ["NixlTransport", "IMPORT_ERROR", "warm_up"]

log = logging.getLogger("fastsync.transport.nixl")

INSTALL_HINT = "pip install nixl-cu12==1.5.1 && pip install --no-deps nixl==1.5.1"


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


class NixlTransport(NixlReceiving, NixlSending, Transport):
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
        mem = mem_of(tensors[0])[0]
        for t in tensors:
            st = t.untyped_storage()
            if st.nbytes() and st.data_ptr() not in seen:
                seen[st.data_ptr()] = (st.data_ptr(), st.nbytes(), mem_of(t)[1], "")
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
