"""In place or full copy (``fastsync.host.path_choice``): trainer rank 0 decides in place only when
every rollout rank can and the trainer sends shards, otherwise the full copy with the reason, or a
ConfigError naming the host's policy key under ``on``; the session's versions start above what any
engine holds. Real control store (the verl backend's use of it: tests/adapters)."""

from __future__ import annotations

import json

import pytest

from fastsync import ConfigError
from fastsync.host import MODE_KEY, decide_path, publish_capability, read_path


def test_rank0_decides_in_place_only_when_every_side_can(ctl) -> None:
    publish_capability(ctl, 0, True, "", True, 1)
    publish_capability(ctl, 1, True, "", True, 1)
    got = decide_path(ctl, 2, None, "auto", 5, version=3)
    assert got == {"mode": "inplace", "why": "", "leaders": [[0, 1], [1, 1]], "version": 3}
    assert read_path(ctl, 5, "rollout rank 1") == got
    # a new master (fresh backend, version 1) meeting engines an earlier session synced: the
    # session's versions start above the newest any engine served or began
    publish_capability(ctl, 1, True, "", True, 1, held=12)
    assert decide_path(ctl, 2, None, "auto", 5, version=1)["version"] == 13
    assert decide_path(ctl, 2, None, "auto", 5, version=20)["version"] == 20
    # a trainer without shards: full tensors, named (fresh buffers per session: the version stays)
    got = decide_path(ctl, 2, "engine_kwargs.fastsync.trainer_shards='off'", "auto", 5, version=1)
    assert got["mode"] == "fulltensor" and "trainer_shards='off'" in got["why"] and got["version"] == 1
    # one rollout rank that cannot (SGLang, wrong extension): fallback naming the rank, refused under 'on'
    publish_capability(ctl, 1, False, "rollout.name='sglang'", False, 0)
    got = decide_path(ctl, 2, None, "auto", 5, version=1)
    assert got["mode"] == "fulltensor" and got["why"] == "rollout rank 1: rollout.name='sglang'"
    with pytest.raises(ConfigError, match="engine_kwargs.fastsync.inplace='on'.*rollout rank 1: rollout.name='sglang'"):
        decide_path(ctl, 2, None, "on", 5, version=1, policy_key="engine_kwargs.fastsync.inplace")
    with pytest.raises(ConfigError, match="refused the session"):  # the others get the refusal, not a timeout
        read_path(ctl, 5, "rollout rank 0")
    assert json.loads(ctl.get(MODE_KEY, 5))["mode"] == "error"
