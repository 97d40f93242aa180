"""Calls answered through the control store (``fastsync.host.store_rpc``), as verl's server uses
them: a real store, worker objects answering in place of vLLM workers (the verl backend's live
use: tests/adapters/test_verl_smoke.py and the sync matrix)."""

from __future__ import annotations

import pytest

from fastsync import ConfigError, SyncError
from fastsync.host import answer_to_store, store_replies, store_request


class _Worker:
    def __init__(self, rank: int) -> None:
        self.rank = rank

    def fastsync_version(self) -> int:
        return 7 + self.rank

    def fastsync_update(self, version: int) -> dict:
        raise SyncError(f"worker {self.rank}: version {version} incomplete")


def test_every_worker_answers_in_rank_order_and_keys_are_unique(ctl) -> None:
    req = store_request(ctl, "fastsync_version", (), caller="rollout0")
    assert req["reply"] != store_request(ctl, "fastsync_version", (), caller="rollout0")["reply"]
    workers = [_Worker(1), _Worker(0)]
    assert all(answer_to_store(w, req, ("fastsync_version",)) for w in workers)
    assert store_replies(ctl, req, 2, "engine 0: version") == [7, 8]


def test_a_worker_error_comes_back_by_class_and_a_missing_reply_has_a_deadline(ctl) -> None:
    req = store_request(ctl, "fastsync_update", (3,), caller="r")
    answer_to_store(_Worker(0), req, ("fastsync_update",))
    with pytest.raises(SyncError, match="worker 0: version 3 incomplete"):
        store_replies(ctl, req, 1, "engine 0: update")
    with pytest.raises(SyncError, match="reply of worker 1"):
        store_replies(ctl, req, 2, "engine 0: update", timeout_s=0.5)


def test_a_method_outside_the_allowed_calls_is_refused_by_name(ctl) -> None:
    req = store_request(ctl, "fastsync_close", (), caller="r")
    answer_to_store(_Worker(0), req, ("fastsync_version",))
    with pytest.raises(ConfigError, match="'fastsync_close' is not one of"):
        store_replies(ctl, req, 1, "engine 0: close")
