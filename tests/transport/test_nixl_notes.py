"""The one notification codec of NIXL writes (dense ``fs``, delta ``fsd``, relay ``fr``): what
it accepts and what it refuses. Pure Python; the transports' own tests run it over real NIXL."""

from __future__ import annotations

import pytest

import fastsync.transport.nixl.notes as notes

KEY = b"k" * 32


def _note(kind: str = "fs", **kw: int) -> bytes:
    args = dict(version=7, src=2, a=3, b=5) | kw
    return notes.encode(KEY, kind, sender_agent="agent-t2", dst=1, **args)


@pytest.mark.parametrize("kind", sorted(notes.KINDS))
def test_round_trip_and_mac(kind: str) -> None:
    n = notes.decode(_note(kind), kind)
    assert (n.kind, n.version, n.src, n.a, n.b) == (kind, 7, 2, 3, 5)
    assert notes.authentic(KEY, n, agent="agent-t2", dst=1)
    assert not notes.authentic(KEY, n, agent="agent-x", dst=1)  # another agent replays it
    assert not notes.authentic(KEY, n, agent="agent-t2", dst=0)  # redirected to another rank
    assert not notes.authentic(b"j" * 32, n, agent="agent-t2", dst=1)  # not this job's key


def test_other_kinds_are_not_this_one_and_bad_ones_are_malformed() -> None:
    assert notes.decode(_note("fsd"), "fs") is None and notes.decode(_note("fs"), "fr") is None
    for raw in (b"fs|1|2|3", b"fs|x|2|3|4|00", b"fs|1|2|3|4|zz", b"fs|1|2|3|4|5|6"):
        with pytest.raises(ValueError):
            notes.decode(raw, "fs")
    with pytest.raises(ValueError, match="unknown notification kind"):
        notes.encode(KEY, "zz", sender_agent="a", dst=0, version=1, src=0, a=0, b=1)


def test_forged_fields_and_short_tags_are_refused() -> None:
    good = _note().decode()
    tag = good.rsplit("|", 1)[1]
    moved = good.replace("fs|7|", "fs|8|", 1).encode()  # same MAC, another version
    assert not notes.authentic(KEY, notes.decode(moved, "fs"), agent="agent-t2", dst=1)
    for short in (tag[:2], tag[:8], ""):  # a truncated MAC must not be checked truncated
        n = notes.decode(good.replace(tag, short).encode(), "fs")
        assert not notes.authentic(KEY, n, agent="agent-t2", dst=1)
