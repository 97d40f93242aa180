"""A version's payload on the engine side: what one version carries and how it is applied, under
the one session :class:`~fastsync.sync.receiver.WeightReceiver` runs for every version.
:class:`Payload` is the protocol; :class:`DensePayload` the planned writes through the landing
memory (the delta payload is :class:`~fastsync.sync.delta_receiver.DeltaPayload`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from fastsync.executor.metrics import SyncMetrics

if TYPE_CHECKING:
    from fastsync.sync.receiver import WeightReceiver

__all__ = ["Payload", "DensePayload"]


class Payload(Protocol):
    """What one version carries and how it is applied; the session (:class:`WeightReceiver`)
    calls these in order: ``begin`` (arm; nothing published yet), ``announce`` (what the senders
    must know before ``begun`` is published), ``poll`` until True,
    ``commit`` (verify and apply; raising rolls the version back), then ``settle`` after a
    successful flip or ``rollback`` after any failure."""

    kind: str  # "dense" or "delta": the metrics' transport name says which

    def begin(self, version: int, m: SyncMetrics) -> None: ...
    def announce(self, version: int) -> None: ...
    def poll(self) -> bool: ...
    def missing(self) -> dict[Any, str]: ...
    def senders(self) -> list[int]: ...
    def commit(self, version: int, m: SyncMetrics) -> None: ...
    def link_bytes(self) -> dict[str, int]: ...
    def settle(self) -> None: ...
    def rollback(self) -> str: ...


class DensePayload:
    """The planned writes: the transport lands them in the landing memory (shadow or in place);
    the flip is the landing's ``apply``, the rollback its ``rollback``."""

    kind = "dense"

    def __init__(self, rx: "WeightReceiver") -> None:
        self.rx = rx

    def begin(self, version: int, m: SyncMetrics) -> None:
        with m.stage("backup"):
            self.rx.landing.begin()
        self.rx.transport.begin_receive(version)

    def announce(self, version: int) -> None:
        pass  # a receiver without inboxes publishes no mode: senders read "dense"

    def poll(self) -> bool:
        return self.rx.transport.poll_receive()

    def missing(self) -> dict[Any, str]:
        return self.rx.transport.missing()

    def senders(self) -> list[int]:
        assert self.rx.program is not None
        return list(self.rx.program.by_src)

    def commit(self, version: int, m: SyncMetrics) -> None:
        rx = self.rx
        assert rx.program is not None
        if rx.verify:
            with m.stage("verify"):
                rx.verify_against_senders(version, rx.transport.checksum_ranks(rx.program), rx.landing.regions)
        with m.stage("apply"):
            rx.landing.apply()
        rx.last_stats = {"mode": "dense"}

    def link_bytes(self) -> dict[str, int]:
        """Planned bytes per link: trainer -> this rank, and this rank -> each child replica it relays to."""
        program = self.rx.program
        assert program is not None
        me = self.rx.rank
        out = {f"t{s}->r{me}": sum(i.transfer.nbytes for i in items) for s, items in program.by_src.items()}
        if program.relay is not None:  # engine -> engine links: what this rank forwarded to each child replica
            for child, units in program.relay.children.items():
                out[f"r{me}->r{child}"] = sum(it.transfer.nbytes for items in units.values() for it in items)
        return out

    def settle(self) -> None:
        self.rx.transport.end_receive()

    def rollback(self) -> str:
        try:
            self.rx.transport.end_receive()
        finally:
            intact = self.rx.landing.rollback()
        return "" if intact else " (in-place tensors are torn: no backup)"
