"""One write an engine rank expects (``RecvItem``): shared by the receive program
(``program.py``) and the relay program (``relay.py``), which builds the items that reach a rank
by relay, so neither imports the other's module to name it."""

from __future__ import annotations

from dataclasses import dataclass

from fastsync.plan.types import Transfer

__all__ = ["RecvItem"]


@dataclass(slots=True)
class RecvItem:
    """Transfer ``transfer`` (flat plan index ``index``) lands in the byte runs ``dst_runs``
    (offset, length) of its engine tensor."""

    index: int
    transfer: Transfer
    dst_runs: list[tuple[int, int]]
