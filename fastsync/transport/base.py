"""The transport protocol: how planned bytes move from trainer ranks to engine ranks.

A transport instance lives in one process and plays one role: sender (trainer rank) or receiver
(engine rank). The executor (``fastsync.sync.sender`` / ``receiver``) owns the plan, the
staging and landing memory and the version handshake; the transport only moves bytes and says
when they arrived. The public methods here check state and arguments, then call the ``_method``
each backend implements.

Lifecycle, sender: ``setup_sender(ctx)`` once, then ``send(version, ...)`` per sync, ``close()``.
Lifecycle, receiver: ``setup_receiver(ctx)`` once, then per sync ``begin_receive(version)``,
``poll_receive()`` until True (or the deadline), ``end_receive()``; ``close()`` at the end.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from fastsync.control import ControlPlane
from fastsync.errors import ConfigError, TransportError
from fastsync.executor.metrics import SyncMetrics
from fastsync.executor.verify import Digests
from fastsync.executor.pack import Packer
from fastsync.executor.program import RecvProgram, SendProgram
from fastsync.executor.staging import Landing
from fastsync.layout.types import Shard
from fastsync.plan.types import Plan

__all__ = ["World", "SenderContext", "ReceiverContext", "Transport"]


@dataclass(frozen=True, slots=True)
class World:
    """Trainer ranks ``0..T-1`` and engine ranks ``0..R-1``; in a torch process group the
    engine rank ``d`` is global rank ``T + d``."""

    num_trainers: int
    num_receivers: int

    @property
    def size(self) -> int:
        return self.num_trainers + self.num_receivers

    def trainer(self, rank: int) -> int:
        return rank

    def receiver(self, rank: int) -> int:
        return self.num_trainers + rank


@dataclass(slots=True)
class SenderContext:
    rank: int
    plan: Plan
    program: SendProgram
    packer: Packer
    control: ControlPlane
    world: World
    timeout_s: float
    sources: dict[str, torch.Tensor] = field(default_factory=dict)
    shards: dict[str, list[Shard]] = field(default_factory=dict)


@dataclass(slots=True)
class ReceiverContext:
    rank: int
    plan: Plan
    program: RecvProgram
    landing: Landing
    control: ControlPlane
    world: World
    timeout_s: float


class Transport(ABC):
    """One byte-moving mechanism. Subclasses set ``name`` and implement the ``_methods``."""

    name: ClassVar[str] = "?"
    #: False for transports that never read the sender's staging slots (no arena is allocated).
    uses_staging: ClassVar[bool] = True
    #: Plans whose identical replicas are planned once (``Plan.fanout``): can this transport run
    #: them (``fanout``), and can its engine ranks relay copies to other engine ranks (``relays``)?
    fanout: ClassVar[bool] = True
    relays: ClassVar[bool] = False
    #: True when trainer rank 0's send is a collective over every engine rank (a broadcast), so it
    #: must wait until every engine rank has begun the version, not only the ones it writes to.
    rank0_reaches_all: ClassVar[bool] = False

    def __init__(self) -> None:
        self.sender: SenderContext | None = None
        self.receiver: ReceiverContext | None = None
        self._receiving: int | None = None
        self.posted_hook: Callable[[], None] | None = None  # send()'s on_posted, while it runs

    # ---- sender -------------------------------------------------------------------------
    def setup_sender(self, ctx: SenderContext) -> None:
        if self.sender is not None or self.receiver is not None:
            raise TransportError(f"transport {self.name!r}: already set up in this instance; make one per role")
        self._check_plan(ctx.plan, f"trainer rank {ctx.rank}")
        self.sender = ctx
        self._setup_sender(ctx)

    def send(
        self,
        version: int,
        deadline: float,
        metrics: SyncMetrics,
        crcs: Digests | None = None,
        on_chunk: Callable[[int], None] | None = None,
        on_posted: Callable[[], None] | None = None,
    ) -> None:
        """Move this trainer rank's share of ``version``; returns once every write is complete
        on this side (receivers learn it through the transport's completion signal). With
        ``crcs``, feed every transfer's bytes to its digest (``fastsync.executor.verify.Digests``).
        ``on_posted``: called once every write is posted (every digest is final then) and before
        waiting for them to complete, by transports that can tell (``posted_hook``); others
        never call it."""
        if self.sender is None:
            raise TransportError(f"transport {self.name!r}: send() before setup_sender()")
        self.posted_hook = on_posted
        try:
            self._send(version, deadline, metrics, crcs, on_chunk)
        finally:
            self.posted_hook = None

    def expect_endpoints(self, endpoints: dict[int, str]) -> None:
        """Sender, before ``send``: the endpoint each engine rank announced for this version (its
        ``begun`` value; "" where it named none). A transport whose peers renew their endpoint
        (NIXL after a failed version) reconnects to a changed one here; others ignore it."""
        return None

    def endpoint(self) -> str:
        """Receiver: the name of the endpoint it receives on, announced with ``begun`` ("" when
        the transport has nothing to announce)."""
        return ""

    def checksum_ranks(self, program: RecvProgram) -> list[int]:
        """Trainer ranks whose published checksums cover what this receiver gets (relayed too)."""
        return sorted({s for s, _ in program.by_origin()})

    # ---- receiver -----------------------------------------------------------------------
    def setup_receiver(self, ctx: ReceiverContext) -> None:
        if self.sender is not None or self.receiver is not None:
            raise TransportError(f"transport {self.name!r}: already set up in this instance; make one per role")
        self._check_plan(ctx.plan, f"engine rank {ctx.rank}")
        self.receiver = ctx
        self._setup_receiver(ctx)

    def begin_receive(self, version: int) -> None:
        if self.receiver is None:
            raise TransportError(f"transport {self.name!r}: begin_receive() before setup_receiver()")
        if self._receiving is not None:
            raise TransportError(
                f"transport {self.name!r}: version {version} begun while version {self._receiving} is still open"
            )
        self._receiving = version
        self._begin_receive(version)

    def poll_receive(self) -> bool:
        """True once every expected byte of the open version has landed. Never blocks long."""
        if self._receiving is None:
            raise TransportError(f"transport {self.name!r}: poll_receive() with no version open")
        return self._poll_receive()

    def missing(self) -> dict[int, str]:
        """Sending rank -> what has not arrived from it yet (empty when complete)."""
        return self._missing() if self._receiving is not None else {}

    def end_receive(self) -> None:
        """Close the open version (after success or failure)."""
        if self._receiving is None:
            return
        try:
            self._end_receive()
        finally:
            self._receiving = None

    def close(self) -> None:
        self._close()

    def _check_plan(self, plan: Plan, who: str) -> None:
        """Refuse, before any byte moves, a plan shape this transport cannot execute."""
        if plan.fanout is not None and not self.fanout:
            raise ConfigError(f"{who}: transport {self.name!r} cannot run a plan whose replicas are planned once "
                              "(Plan.fanout); build the plan with fanout='off'")
        if plan.has_relays and not self.relays:
            raise ConfigError(f"{who}: transport {self.name!r} cannot relay between engine ranks; the plan relays "
                              f"{plan.fanout.replicas - sum(p < 0 for p in plan.fanout.parents)} replica(s): "
                              "use transport 'nixl' or build the plan with fanout='direct'")

    # ---- backend ------------------------------------------------------------------------
    @abstractmethod
    def _setup_sender(self, ctx: SenderContext) -> None: ...

    @abstractmethod
    def _send(self, version: int, deadline: float, metrics: SyncMetrics, crcs: Digests | None,
              on_chunk: Callable[[int], None] | None) -> None: ...

    @abstractmethod
    def _setup_receiver(self, ctx: ReceiverContext) -> None: ...

    @abstractmethod
    def _begin_receive(self, version: int) -> None: ...

    @abstractmethod
    def _poll_receive(self) -> bool: ...

    @abstractmethod
    def _missing(self) -> dict[int, str]: ...

    def _end_receive(self) -> None:
        return None

    def _close(self) -> None:
        return None

    def describe(self) -> dict[str, Any]:
        return {"name": self.name}
