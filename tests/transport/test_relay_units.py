"""How a relaying engine rank cuts what it forwards into units (``NixlRelay._cut_units``): one
unit per trainer write batch into the chain's root rank, holding the byte ranges that batch wrote,
so a transfer split over many batches (a large embedding) is forwarded piece by piece as it lands
instead of whole after its last batch (which made every hop of a chain store-and-forward it).
No NIXL agent is made: the units come from the control plane alone."""

from __future__ import annotations

import json
import types

import pytest

from fastsync.errors import TransportError
from fastsync.executor.recv_item import RecvItem
from fastsync.executor.relay import RelayProgram
from fastsync.plan.types import Transfer
from fastsync.protocol import batches_key
from fastsync.transport.nixl.relay import NixlRelay


class _Store:
    def __init__(self, values: dict[str, str]) -> None:
        self.values = values

    def get(self, key: str, timeout_s: float, what: str = "") -> bytes:
        return self.values[key].encode()


def _relay(batches: list[list[list[int]]]) -> NixlRelay:
    w = Transfer(0, 0, "w", ((0, 30), (0, 50)), "w", ((0, 30), (0, 50)), "copy", 3000)
    b = Transfer(0, 0, "b", ((0, 250),), "b", ((0, 250),), "copy", 500)
    n = 2
    # engine rank 1 of a chain 0 -> 1 -> 2 (tp1 replicas): both transfers come from rank 0, go to rank 2
    prog = RelayProgram(1, upstream=0, root_rank=0, num_transfers=n,
                        incoming={0: [RecvItem(0 * n + 0, w, [(0, 3000)]), RecvItem(0 * n + 1, b, [(0, 500)])]},
                        children={2: {0: [RecvItem(2 * n + 0, w, [(0, 3000)]), RecvItem(2 * n + 1, b, [(0, 500)])]}})
    control = _Store({batches_key(0, 0): json.dumps(batches)})
    ctx = types.SimpleNamespace(control=control, rank=1, timeout_s=5.0)
    return NixlRelay(None, ctx, prog, lambda t: ("DRAM", 0), key=b"k", agent_name="a1", refuse=lambda *a: None)


def test_a_transfer_split_over_batches_is_forwarded_batch_by_batch() -> None:
    relay = _relay([[[0, 0, 1000]], [[0, 1000, 1000], [1, 0, 500]], [[0, 2000, 1000]]])
    relay._cut_units()
    assert relay.units == [
        (0, 0, {0: [(0, 1000)]}),
        (0, 1, {0: [(1000, 1000)], 1: [(0, 500)]}),
        (0, 2, {0: [(2000, 1000)]}),
    ]


def test_a_relayed_transfer_no_batch_carries_is_refused_by_name() -> None:
    relay = _relay([[[0, 0, 3000]]])  # transfer 1 ("b") is in no batch
    with pytest.raises(TransportError, match="trainer rank 0 writes no batch carrying transfer 1 into engine rank 0"):
        relay._cut_units()


class _Write:
    def __init__(self) -> None:
        self.handle = object()

    def post(self, msg: bytes) -> str:
        return "OK"


class _Agent:
    def __init__(self) -> None:
        self.done: set[int] = set()

    def check_xfer_state(self, handle: object) -> str:
        return "DONE" if id(handle) in self.done else "PROC"


def test_a_relay_keeps_a_bounded_number_of_forwards_in_flight_per_child() -> None:
    """Over TCP a forward's notification queues behind every forward posted before it on the same
    connection: a relay that posted every landed unit at once held the next hop's notifications
    behind all of them (4.2 s per hop in a chained reload at 0.1 Gb/s). It posts at most
    FORWARDS_IN_FLIGHT per child, and more as earlier ones are seen done."""
    from fastsync.transport.nixl.relay import FORWARDS_IN_FLIGHT

    units = FORWARDS_IN_FLIGHT + 4
    per = 3000 // units
    relay = _relay([[[0, k * per, per if k < units - 1 else 3000 - k * per]] + ([[1, 0, 500]] if k == 0 else [])
                    for k in range(units)])
    relay._cut_units()
    agent = _Agent()
    relay.agent = agent
    relay._version, relay._got, relay._armed = 1, set(range(units)), {2}  # every unit arrived from upstream
    relay._handles = {(2, u): _Write() for u in range(units)}
    relay.pump(lambda origin: ())
    assert len(relay._posted) == FORWARDS_IN_FLIGHT
    assert not relay.forwards_done()
    agent.done = {id(relay._posted[(2, u)][0]) for u in range(3)}  # the first three finished
    assert not relay.forwards_done()
    relay.pump(lambda origin: ())
    assert len(relay._posted) == FORWARDS_IN_FLIGHT + 3 and len(relay._moving) == FORWARDS_IN_FLIGHT
    agent.done = {id(hs[0]) for hs in relay._posted.values()}
    assert not relay.forwards_done()  # all posted ones done, one unit not posted yet
    relay.pump(lambda origin: ())
    assert len(relay._posted) == units and not relay.forwards_done()
    agent.done = {id(hs[0]) for hs in relay._posted.values()}
    assert relay.forwards_done()
