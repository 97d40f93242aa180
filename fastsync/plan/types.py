"""The static schedule: computed once from both layouts, replayed after every training step.

A :class:`Plan` is a flat list of :class:`Transfer` records plus the owner gathers some of them
need. Each transfer writes one box of one engine tensor on one engine rank from one trainer
rank. Receivers use the same plan to know exactly which regions must arrive before a version flip.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field

from fastsync.errors import PlanError
from fastsync.layout.box import Box
from fastsync.layout.types import fingerprint

__all__ = ["Transfer", "Fanout", "Plan"]


@dataclass(frozen=True, slots=True)
class Transfer:
    """``inference[dst_rank][dst_tensor][dst_box] = transform(trainer_full[src_param][src_box])``,
    sent by trainer ``src_rank``.

    When ``gathered`` is False the source box lies inside a shard ``src_rank`` already holds, so
    it is sliced locally with no collective. When True, ``src_rank`` is the owner of ``src_param``
    in ``Plan.gathers`` and reads from the full tensor it gathered first.
    ``nbytes`` is the size written at the destination (after any cast/quantisation).
    """

    src_rank: int
    dst_rank: int
    dst_tensor: str
    dst_box: Box
    src_param: str
    src_box: Box
    transform: str
    nbytes: int
    gathered: bool = False


@dataclass(frozen=True, slots=True)
class Fanout:
    """How ``replicas`` identical engines of ``replica_size`` ranks each get the transfers planned
    for the first one (``Plan.transfers``, engine ranks ``0..replica_size-1``).

    Copy ``(i, k)`` of transfer ``i`` lands on engine rank ``dst_rank + k * replica_size``. It is
    written by the transfer's trainer rank when ``parents[k] == -1`` or ``i`` is in ``direct``;
    otherwise engine rank ``dst_rank + parents[k] * replica_size`` relays it (a WRITE from its own
    memory, after copy ``(i, parents[k])`` landed there). ``parents`` form a forest rooted at
    replicas fed by trainers; see ``plan/replicate.py`` (expansion) and ``plan/relay.py`` (choice).
    """

    replica_size: int
    replicas: int
    parents: tuple[int, ...]
    direct: tuple[int, ...] = ()  # sorted transfer indices sent straight to every replica

    def __post_init__(self) -> None:
        # a parent precedes its child: no cycles, so relays always start at a trainer-fed replica
        if self.replica_size < 1 or self.replicas < 1 or len(self.parents) != self.replicas:
            raise PlanError(f"fanout: {self.replicas} replicas of {self.replica_size} ranks with "
                            f"{len(self.parents)} parents")
        bad = [k for k, p in enumerate(self.parents) if not -1 <= p < k]
        if bad:
            raise PlanError(f"fanout: replica {bad[0]} has parent {self.parents[bad[0]]}; a parent must be -1 "
                            "(fed by trainer ranks) or an earlier replica")
        if any(b <= a for a, b in zip(self.direct, self.direct[1:])) or (self.direct and self.direct[0] < 0):
            raise PlanError("fanout: direct transfer indices must be sorted, distinct and non-negative")

    @property
    def relays(self) -> bool:
        """Some replica is fed by another (unless every transfer is in ``direct``)."""
        return any(p >= 0 for p in self.parents)

    def depth(self, k: int) -> int:
        d = 0
        while self.parents[k] >= 0:
            k, d = self.parents[k], d + 1
        return d

    def to_json(self) -> list:
        return [self.replica_size, self.replicas, list(self.parents), list(self.direct)]


@dataclass(slots=True)
class Plan:
    """The whole schedule, serialisable, bound to the two layouts by their fingerprints.

    With ``fanout`` set, ``transfers`` are those of the first engine replica only and ``fanout``
    says how every other replica gets them (straight from trainer ranks or relayed by engine
    ranks); the views below count every copy. ``plan/replicate.py`` expands such a plan."""

    transfers: list[Transfer]
    gathers: dict[str, int]
    trainer_hash: str
    engine_hash: str
    num_trainers: int
    num_receivers: int
    meta: dict = field(default_factory=dict)
    fanout: Fanout | None = None
    #: Engine tensors the engine pads, per planned engine rank: ``{rank: {tensor: (logical shape,
    #: engine shape)}}``. Transfers' ``dst_box`` are in the engine's (padded) coordinates and cover
    #: the logical sub-box only; receivers check their live shapes against the engine shape.
    padded: dict[int, dict[str, tuple[tuple[int, ...], tuple[int, ...]]]] = field(default_factory=dict)

    def padded_shapes(self, rank: int, tensor: str) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
        """(logical, engine) shape of ``tensor`` on engine ``rank`` where the engine pads it (rank
        of any replica), else None."""
        if self.fanout is not None:
            rank %= self.fanout.replica_size
        return self.padded.get(rank, {}).get(tensor)

    @property
    def has_relays(self) -> bool:
        """Some copy is written by an engine rank rather than a trainer rank."""
        f = self.fanout
        return f is not None and f.relays and len(f.direct) < len(self.transfers)

    # ---- views (every copy counted; relayed copies are not trainer sends) -------------------
    def _copies(self) -> tuple[int, int, set[int]]:
        """(replicas fed by trainers, replicas, indices sent to every replica directly)."""
        f = self.fanout
        if f is None:
            return 1, 1, set()
        return sum(1 for p in f.parents if p < 0), f.replicas, set(f.direct)

    def send_bytes(self) -> list[int]:
        """Bytes each trainer rank sends (every direct copy)."""
        roots, reps, direct = self._copies()
        out = [0] * self.num_trainers
        for i, t in enumerate(self.transfers):
            out[t.src_rank] += t.nbytes * (reps if i in direct else roots)
        return out

    def recv_bytes(self) -> list[int]:
        """Bytes each engine rank receives, relayed or direct."""
        out = [0] * self.num_receivers
        for t in self.transfers:
            out[t.dst_rank] += t.nbytes
        f = self.fanout
        if f is not None:
            e = f.replica_size
            for k in range(1, f.replicas):
                out[k * e:(k + 1) * e] = out[:e]
        return out

    @property
    def bytes_total(self) -> int:
        n = sum(t.nbytes for t in self.transfers)
        return n * (self.fanout.replicas if self.fanout else 1)

    # ---- identity ----------------------------------------------------------------------
    def to_json(self) -> dict:
        out = {
            "version": 1,
            "trainer_hash": self.trainer_hash,
            "engine_hash": self.engine_hash,
            "num_trainers": self.num_trainers,
            "num_receivers": self.num_receivers,
            "gathers": dict(sorted(self.gathers.items())),
            "meta": self.meta,
            "transfers": [
                [t.src_rank, t.dst_rank, t.dst_tensor, [list(b) for b in t.dst_box], t.src_param,
                 [list(b) for b in t.src_box], t.transform, t.nbytes, t.gathered]
                for t in self.transfers
            ],
        }
        if self.fanout is not None:
            out["fanout"] = self.fanout.to_json()
        if self.padded:  # absent when nothing is padded: unpadded plans keep their hashes
            out["padded"] = {str(r): {n: [list(lg), list(en)] for n, (lg, en) in sorted(ts.items())}
                             for r, ts in sorted(self.padded.items())}
        return out

    @property
    def plan_hash(self) -> str:
        """``json_hash()``'s value, written without building the JSON (``fastsync.plan.fingerprint``):
        every trainer and engine rank checks it at set-up, seconds of CPU for Kimi-K2's plan."""
        from fastsync.plan.fingerprint import plan_hash

        return plan_hash(self)

    def json_hash(self) -> str:
        """The contract: a SHA-256 (16 hex digits) of the plan's JSON (``to_json()``, ``meta``
        left out, keys sorted)."""
        body = self.to_json()
        body.pop("meta")
        return fingerprint(body)

    def dumps(self) -> str:
        return json.dumps(self.to_json(), separators=(",", ":"))

    @classmethod
    def loads(cls, text: str) -> "Plan":
        try:
            d = json.loads(text)
            transfers = [
                Transfer(s, r, tn, tuple(tuple(b) for b in db), sp, tuple(tuple(b) for b in sb), tf, nb, g)
                for s, r, tn, db, sp, sb, tf, nb, g in d["transfers"]
            ]
            fan = None
            if d.get("fanout") is not None:
                size, reps, parents, direct = d["fanout"]
                fan = Fanout(int(size), int(reps), tuple(int(p) for p in parents), tuple(int(i) for i in direct))
            padded = {int(r): {n: (tuple(int(x) for x in lg), tuple(int(x) for x in en)) for n, (lg, en) in ts.items()}
                      for r, ts in (d.get("padded") or {}).items()}
            return cls(transfers, dict(d["gathers"]), d["trainer_hash"], d["engine_hash"],
                       d["num_trainers"], d["num_receivers"], d.get("meta", {}), fan, padded)
        except (KeyError, ValueError, TypeError) as e:
            raise PlanError(f"not a serialised fastsync plan: {e}") from e

    def check_layouts(self, trainer_hash: str, engine_hash: str) -> None:
        """Refuse to replay against a changed topology: raises PlanError naming the side."""
        if trainer_hash != self.trainer_hash:
            raise PlanError(f"plan was built for trainer layout {self.trainer_hash}, got {trainer_hash}: re-plan")
        if engine_hash != self.engine_hash:
            raise PlanError(f"plan was built for engine layout {self.engine_hash}, got {engine_hash}: re-plan")
