"""The notification codec of every NIXL write fastsync makes (dense batches, delta pages, relay
units): one format, one MAC rule, one parser.

A notification follows the bytes it announces on the same connection, so it arrives only after
them. It reads ``kind|version|src|a|b|mac``: ``kind`` ``fs`` (a dense batch: ``a`` = batch index,
``b`` = batches this sender posts to this receiver), ``fsd`` (a delta page: page ``a`` of ``b``) or
``fr`` (a relay unit: unit ``a`` of ``b`` in the chain) or ``fdr`` (a relayed delta page: page ``a``
of ``b`` of trainer rank ``src``'s stream, forwarded by the upstream engine rank); ``src`` the
sending rank (a trainer rank, or for ``fr`` the upstream engine rank). ``mac`` is the job key's MAC over the kind, the sender's
NIXL agent name, the receiving rank and the four numbers, so a notification cannot be forged,
redirected to another rank, or moved to another version, batch or agent. What a receiver checks
beyond the MAC (the agent is the one the sender announced, the version is the open one, the index
is in range) stays with the receiver, which knows what it expects.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastsync.security import check_mac, mac

__all__ = ["KINDS", "TAG_BYTES", "Note", "encode", "decode", "authentic", "missing"]

#: Bytes of the MAC a notification carries (``security.mac``'s default size).
TAG_BYTES = 16

#: The notification kinds and what each announces.
KINDS = {"fs": "dense batch", "fsd": "delta page", "fr": "relay unit", "fdr": "relayed delta page"}


@dataclass(frozen=True, slots=True)
class Note:
    kind: str
    version: int
    src: int
    a: int
    b: int
    tag: bytes


def _fields(kind: str, sender_agent: str, dst: int, version: int, src: int, a: int, b: int) -> tuple[str, ...]:
    return (kind, sender_agent, str(dst), str(version), str(src), str(a), str(b))


def encode(key: bytes, kind: str, *, sender_agent: str, dst: int, version: int, src: int, a: int, b: int) -> bytes:
    """The signed notification ``sender_agent`` posts to rank ``dst`` after a write."""
    if kind not in KINDS:
        raise ValueError(f"unknown notification kind {kind!r}; known: {sorted(KINDS)}")
    tag = mac(key, *_fields(kind, sender_agent, dst, version, src, a, b)).hex()
    return f"{kind}|{version}|{src}|{a}|{b}|{tag}".encode()


def decode(raw: bytes, kind: str) -> Note | None:
    """``raw`` read as a notification of ``kind``: None when it is not of that kind at all,
    ValueError when it says it is but does not parse (a receiver counts that as malformed)."""
    parts = raw.decode(errors="replace").split("|")
    if parts[0] != kind:
        return None
    if len(parts) != 6:
        raise ValueError(f"{kind} notification with {len(parts)} fields, not 6")
    v, src, a, b = (int(x) for x in parts[1:5])
    return Note(kind, v, src, a, b, bytes.fromhex(parts[5]))


def authentic(key: bytes, note: Note, *, agent: str, dst: int) -> bool:
    """Whether ``note``, received from NIXL agent ``agent`` on rank ``dst``, carries the job's MAC."""
    if len(note.tag) != TAG_BYTES:  # a short tag would be checked truncated: a guess in 256 for one byte
        return False
    return check_mac(key, note.tag, *_fields(note.kind, agent, dst, note.version, note.src, note.a, note.b))


def missing(expect: dict, got: dict, *, nothing: str, unit: str) -> dict:
    """What a receiver still waits for, per sender (dense batches, delta pages): ``nothing`` for a
    sender none of whose notifications came (its count unknown), else ``"k of n {unit} missing"``;
    senders with all ``n`` arrived are left out. ``expect``: sender -> count it announced (None
    until its first notification); ``got``: sender -> the indices that arrived."""
    out = {}
    for s, n in expect.items():
        if n is None:
            out[s] = nothing
        elif len(got[s]) < n:
            out[s] = f"{n - len(got[s])} of {n} {unit} missing"
    return out
