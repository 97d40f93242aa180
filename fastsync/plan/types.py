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

__all__ = ["Transfer", "Plan"]


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


@dataclass(slots=True)
class Plan:
    """The whole schedule, serialisable, bound to the two layouts by their fingerprints."""

    transfers: list[Transfer]
    gathers: dict[str, int]
    trainer_hash: str
    engine_hash: str
    num_trainers: int
    num_receivers: int
    meta: dict = field(default_factory=dict)

    # ---- views -------------------------------------------------------------------------
    def by_sender(self) -> dict[int, list[Transfer]]:
        out: dict[int, list[Transfer]] = defaultdict(list)
        for t in self.transfers:
            out[t.src_rank].append(t)
        return dict(out)

    def by_receiver(self) -> dict[int, list[Transfer]]:
        out: dict[int, list[Transfer]] = defaultdict(list)
        for t in self.transfers:
            out[t.dst_rank].append(t)
        return dict(out)

    def send_bytes(self) -> list[int]:
        out = [0] * self.num_trainers
        for t in self.transfers:
            out[t.src_rank] += t.nbytes
        return out

    def recv_bytes(self) -> list[int]:
        out = [0] * self.num_receivers
        for t in self.transfers:
            out[t.dst_rank] += t.nbytes
        return out

    @property
    def bytes_total(self) -> int:
        return sum(t.nbytes for t in self.transfers)

    # ---- identity ----------------------------------------------------------------------
    def to_json(self) -> dict:
        return {
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

    @property
    def plan_hash(self) -> str:
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
            return cls(transfers, dict(d["gathers"]), d["trainer_hash"], d["engine_hash"],
                       d["num_trainers"], d["num_receivers"], d.get("meta", {}))
        except (KeyError, ValueError, TypeError) as e:
            raise PlanError(f"not a serialised fastsync plan: {e}") from e

    def check_layouts(self, trainer_hash: str, engine_hash: str) -> None:
        """Refuse to replay against a changed topology: raises PlanError naming the side."""
        if trainer_hash != self.trainer_hash:
            raise PlanError(f"plan was built for trainer layout {self.trainer_hash}, got {trainer_hash}: re-plan")
        if engine_hash != self.engine_hash:
            raise PlanError(f"plan was built for engine layout {self.engine_hash}, got {engine_hash}: re-plan")
