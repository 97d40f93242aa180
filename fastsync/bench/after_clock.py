"""Verification of every benchmark sync, after the clock stops.

An engine rank of ``fastsync bench`` checks, after each sync (timed or not, once its row's
``end`` is taken), that every tensor it serves holds exactly what the version it serves must hold:
a CRC-32 of each tensor against the CRC of an independent reference computed without any
transport (:func:`fastsync.bench.model.reference_tensors`). The reference of a dense run depends
only on the version's parity (version ``v`` holds ``(-1)**v`` times the draw), so it is computed
at most twice per run; a ``--delta`` run computes one per version. Nothing here runs inside a
timed window, so the figures are the syncs' own and every one of them is verified.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from fastsync.executor.staging import as_bytes
from fastsync.executor.verify import crc_update

__all__ = ["AfterClockCheck"]


def _crc(t: torch.Tensor) -> int:
    return crc_update(0, as_bytes(t.contiguous()))


class AfterClockCheck:
    """Per engine rank: ``check(tensors, version)`` -> the names of the tensors that differ from
    what ``version`` must hold (empty when all match). ``delta_fraction``: the run's
    ``--delta-fraction`` when it syncs deltas (the reference then moves every version), else None.

    Example:
        chk = AfterClockCheck(model, rank)
        rx.sync(v)                       # the timed sync; its metrics' end is taken inside
        bad = chk.check(tensors, rx.version)
    """

    def __init__(self, model: Any, rank: int, delta_fraction: float | None = None) -> None:
        self.model, self.rank, self.delta_fraction = model, rank, delta_fraction
        self._crcs: dict[int, dict[str, int]] = {}
        self.last_s = 0.0

    def _key(self, version: int) -> int:
        if self.delta_fraction is not None:
            return version
        return 2 - version % 2  # 1 (odd versions) or 2 (even ones)

    def expected(self, version: int) -> dict[str, int]:
        """CRC per tensor of what this rank must hold at ``version`` (>= 1)."""
        from fastsync.bench.model import reference_tensors

        key = self._key(version)
        if key not in self._crcs:
            if self.delta_fraction is not None:
                self._crcs.clear()  # a delta run's versions only move forward: keep the last one
            want = reference_tensors(self.model, self.rank, key, self.delta_fraction)
            self._crcs[key] = {n: _crc(t) for n, t in want.items()}
        return self._crcs[key]

    def check(self, tensors: dict[str, torch.Tensor], version: int) -> list[str]:
        """Names of the tensors of ``tensors`` that do not hold ``version`` (version 0: all zeros,
        what an engine rank holds before its first sync)."""
        t0 = time.perf_counter()
        try:
            if version == 0:
                return [n for n, t in tensors.items() if bool(as_bytes(t.contiguous()).any())]
            want = self.expected(version)
            return [n for n, t in tensors.items() if want.get(n) != _crc(t)]
        finally:
            self.last_s = time.perf_counter() - t0
