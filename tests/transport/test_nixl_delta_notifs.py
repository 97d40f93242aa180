"""Delta page notifications follow the dense writes' trust rule: only from the agent a sender
announced, with a valid MAC, for the open version. The agent here is a stand-in for NIXL's
notification queue only (no memory moves in this test); the store is the real control plane."""

from __future__ import annotations

import json

import torch

from fastsync.control import TCPStoreControl
from fastsync.security import mac
from fastsync.transport.nixl.delta import DeltaInbox

KEY = b"k" * 32


class _NotifQueue:
    """Stand-in for ``nixl_agent.get_new_notifs`` (agent name -> messages)."""

    def __init__(self) -> None:
        self.queue: dict[str, list[bytes]] = {}

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        out, self.queue = self.queue, {}
        return out


def _msg(agent: str, v: int, src: int, k: int, m: int, key: bytes = KEY, dst: int = 0) -> bytes:
    tag = mac(key, "fsd", agent, str(dst), str(v), str(src), str(k), str(m)).hex()
    return f"fsd|{v}|{src}|{k}|{m}|{tag}".encode()


def test_forged_replayed_and_foreign_pages_are_refused() -> None:
    store = TCPStoreControl.server(port=0, timeout_s=10)
    store.set("nixl/send/1/to/0", json.dumps({"agent": "trainer1", "posts": 1, "bytes": 1}))
    q = _NotifQueue()
    inbox = DeltaInbox(q, 0, {1: torch.zeros(64, dtype=torch.uint8)}, store, poll_sleep_s=0, key=KEY)
    inbox.begin(5)
    q.queue = {
        "intruder": [_msg("intruder", 5, 1, 0, 2)],  # not trainer 1's announced agent
        "trainer1": [_msg("trainer1", 5, 1, 0, 2, key=b"x" * 32),  # bad MAC
                     _msg("trainer1", 4, 1, 1, 2),  # replayed from version 4
                     b"fs|5|1|0|1|00"],  # a dense write's notification: not the delta inbox's
    }
    assert not inbox.poll()
    assert set(inbox.refused) == {"not trainer rank 1's agent", "bad MAC", "another version (late or replayed)"}
    assert inbox.missing() == {1: "no delta page arrived"}
    q.queue = {"trainer1": [_msg("trainer1", 5, 1, 0, 2), _msg("trainer1", 5, 1, 1, 2)]}
    assert inbox.poll()
