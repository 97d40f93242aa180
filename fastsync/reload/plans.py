"""Reload plans, cached per (source layout hash, target layout hash).

A joining engine of a layout seen before, filled from holders of a layout seen before, gets the
plan built the first time: planning is skipped, not repeated. The cache is in memory, bounded
(least recently used goes first); ``hits``/``misses`` say how it did.
"""

from __future__ import annotations

import time
from collections import OrderedDict

from fastsync.errors import ConfigError
from fastsync.layout.types import EngineLayout, ParamSpec, TrainerLayout
from fastsync.plan.types import Plan

__all__ = ["PlanCache"]


class PlanCache:
    """``get(params, source, target)``: the plan for these layouts, built once."""

    def __init__(self, max_entries: int = 64) -> None:
        if max_entries < 1:
            raise ConfigError(f"PlanCache max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self._plans: OrderedDict[tuple[str, str, str, int | None], Plan] = OrderedDict()
        self.hits = 0
        self.misses = 0
        self.last_plan_s = 0.0

    @staticmethod
    def key(source: TrainerLayout, target: EngineLayout, fanout: str = "off",
            max_transfer_bytes: int | None = None) -> tuple[str, str, str, int | None]:
        return source.fingerprint(), target.fingerprint(), fanout, max_transfer_bytes

    def get(self, params: dict[str, ParamSpec], source: TrainerLayout, target: EngineLayout, *, fanout: str = "off",
            max_transfer_bytes: int | None = None) -> Plan:
        """``fanout``/``max_transfer_bytes`` as for ``build_plan`` (several joining engines as
        replicas of one: ``PeerReload.reload_group``); part of the key."""
        from fastsync.plan.planner import build_plan

        k = self.key(source, target, fanout, max_transfer_bytes)
        plan = self._plans.get(k)
        if plan is not None:
            self.hits += 1
            self._plans.move_to_end(k)
            self.last_plan_s = 0.0
            return plan
        self.misses += 1
        t0 = time.perf_counter()
        # always slice (no owner gathers): holders are independent engines with no gather group
        plan = build_plan(params, source, target, min_transfer_bytes=0, fanout=fanout,
                          max_transfer_bytes=max_transfer_bytes)
        self.last_plan_s = time.perf_counter() - t0
        self._plans[k] = plan
        while len(self._plans) > self.max_entries:
            self._plans.popitem(last=False)
        return plan

    def __len__(self) -> int:
        return len(self._plans)
