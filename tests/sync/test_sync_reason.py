"""Which error ``WeightSync.sync`` raises when its sender and an engine handle both failed (CPU,
no engine: a stand-in sender and handle, the control store real)."""

from __future__ import annotations

import pytest
import torch

from fastsync.control import TCPStoreControl
from fastsync.errors import SyncError, TransportError
from fastsync.sync.liveness import wait_key
from fastsync.sync.weight_sync import WeightSync


class _Handle:
    """An engine handle whose update failed with the engines' own reason."""

    def __init__(self, reason: BaseException) -> None:
        self.reason = reason

    def begin_update(self, version: int, timeout_s: float) -> int:
        return version

    def wait_update(self, token: int, timeout_s: float) -> list[dict]:
        raise self.reason


class _Sender:
    """Stands in for the trainer rank's sender: fails its sync with ``fail()``."""

    def __init__(self, fail) -> None:
        self.fail, self.last_metrics = fail, None

    def sync(self, version: int, **_: object):
        self.fail()


@pytest.fixture
def control():
    c = TCPStoreControl.server(port=0, secret="ab" * 32)
    yield c
    c.close()


def _ws(control, sender, reason) -> WeightSync:
    ws = WeightSync(torch.nn.Linear(3, 5), rank=0, world_size=1, control=control, engines=[_Handle(reason)])
    ws.sender = sender
    return ws


def test_a_flip_wait_that_ran_out_raises_the_engines_reason(control):
    """The engines' deadline started later than trainer rank 0's (inside vLLM's start call on a
    loaded host): rank 0's wait for their flip verdict ran out first, but the engine handle has
    their reason (which trainer rank's writes were missing): that is what sync() raises, with
    the timeout chained."""
    def flip_wait_ran_out():
        wait_key(control, "recv/0/flipped/1", 0.0, "engine rank 0 (flip of version 1)", None)

    why = SyncError("engine rank 0: version 1 incomplete, keeping version 0: trainer rank 1 sent nothing")
    ws = _ws(control, _Sender(flip_wait_ran_out), why)
    with pytest.raises(SyncError, match="trainer rank 1 sent nothing") as got:
        ws.sync(1)
    assert "did not publish 'recv/0/flipped/1' by the deadline" in str(got.value.__cause__)


def test_a_sender_failure_of_its_own_stays_what_sync_raises(control):
    """The sender failed for a reason of its own (its transport): that error, not the engines'
    consequence of it."""
    def transport_failed():
        raise TransportError("trainer rank 0: NIXL write to engine rank 0 failed: connection refused")

    ws = _ws(control, _Sender(transport_failed), SyncError("engine rank 0: version 1 incomplete"))
    with pytest.raises(TransportError, match="NIXL write to engine rank 0 failed"):
        ws.sync(1)
