"""Session and version assignment of the host kit (``fastsync.host.sessions``, what the verl backend
stands on), fed as verl's manager feeds it: every rank's ``prepare`` metadata, trainers first. Pure
functions, no processes."""

from __future__ import annotations

import pytest

from fastsync.errors import ConfigError
from fastsync.host import CONTROL_KEY, ID_KEY, JOINED_KEY, MASTER_KEY, MasterState, assign_session


def _meta(master: MasterState, ids: list[str], joined: dict[str, str | None]) -> list[dict]:
    out = [{ID_KEY: i, JOINED_KEY: joined.get(i)} for i in ids]
    out[0].update({CONTROL_KEY: ["127.0.0.1", 1, "ab" * 32], MASTER_KEY: master.spend()})
    return out


def _join(master: MasterState, got, ids: list[str], joined: dict) -> None:
    master.joined(got.session, list(got.members))
    joined.update({i: got.session for i in ids})


def test_same_members_keep_the_session_and_versions_always_advance() -> None:
    m, joined, ids = MasterState(), {}, ["t0", "t1", "r0", "r1"]
    first = assign_session(2, 2, _meta(m, ids, joined))
    assert first.fresh and first.version == 1
    _join(m, first, ids, joined)
    again = assign_session(2, 2, _meta(m, ids, joined))
    assert not again.fresh and again.session == first.session and again.version == 2


def test_remove_then_re_add_opens_new_sessions_each_time() -> None:
    m, joined, ids = MasterState(), {}, ["t0", "t1", "r0", "r1"]
    s1 = assign_session(2, 2, _meta(m, ids, joined))
    _join(m, s1, ids, joined)
    small = ["t0", "t1", "r0"]
    s2 = assign_session(2, 1, _meta(m, small, joined))  # r1 removed
    assert s2.fresh and s2.session != s1.session
    _join(m, s2, small, joined)
    s3 = assign_session(2, 2, _meta(m, ids, joined))  # r1 back: same members as s1, but s1 is not the master's
    assert s3.fresh and s3.session not in (s1.session, s2.session) and s3.version == 3


def test_a_rank_that_lost_its_session_forces_a_new_one() -> None:
    m, joined, ids = MasterState(), {}, ["t0", "t1", "r0"]
    s1 = assign_session(2, 1, _meta(m, ids, joined))
    _join(m, s1, ids, joined)
    joined["r0"] = None  # e.g. its set-up failed
    assert assign_session(2, 1, _meta(m, ids, joined)).fresh


def test_reordered_ranks_are_a_new_session() -> None:
    m, joined = MasterState(), {}
    s1 = assign_session(1, 2, _meta(m, ["t0", "r0", "r1"], joined))
    _join(m, s1, ["t0", "r0", "r1"], joined)
    assert assign_session(1, 2, _meta(m, ["t0", "r1", "r0"], joined)).fresh


def test_bad_metadata_is_refused_naming_what() -> None:
    m = MasterState()
    meta = _meta(m, ["t0", "r0"], {})
    with pytest.raises(ConfigError, match="2 metadata entries for 2 trainer and 1 rollout"):
        assign_session(2, 1, meta)
    with pytest.raises(ConfigError, match="twice"):
        assign_session(1, 1, [meta[0], {ID_KEY: "t0", JOINED_KEY: None}])
