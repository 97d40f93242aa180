"""What a delta sync of a plan moves, predicted from a measured fraction of changed elements.

``fastsync delta-bench`` measures the fraction of engine elements that change per optimizer step
(bf16 at RL learning rates: most updates fall below bf16 resolution). :func:`delta_plan` turns a
plan into the plan of its delta sync: every transfer keeps its endpoints and its bytes become the
expected size of its encoding at that fraction, with the encoder's own cost rules (per chunk of
``DELTA_CHUNK_ELEMS`` elements the cheapest of uint16 positions + values, a bitmap + values, or
dense, plus record headers; ``fp8_block`` weights as whole 128x128 blocks with 4-byte ids, the
fraction read as the fraction of changed blocks). The simulator then prices it like any plan, so
the prediction covers any cluster layout. Changes are assumed spread evenly over transfers.
"""

from __future__ import annotations

from dataclasses import replace

from fastsync.errors import ConfigError
from fastsync.layout.box import box_numel
from fastsync.layout.types import FP8_BLOCK
from fastsync.plan.types import Plan, Transfer

__all__ = ["DELTA_CHUNK_ELEMS", "HEADER_BYTES", "MAX_SPARSE_CHUNK", "delta_transfer_bytes", "delta_plan"]

#: elements per delta chunk (the unit of the dense-vs-delta choice); positions fit uint16
DELTA_CHUNK_ELEMS = 1 << 16
MAX_SPARSE_CHUNK = 1 << 16
#: bytes of a stream header and of each record header
HEADER_BYTES = 64


def _align8(n: float) -> float:
    return -(-n // 8) * 8


def delta_transfer_bytes(t: Transfer, fraction: float, chunk_elems: int = DELTA_CHUNK_ELEMS) -> int:
    """Expected encoded bytes of transfer ``t`` when ``fraction`` of its elements changed."""
    return _delta_bytes(box_numel(t.dst_box), t.nbytes, t.transform, fraction, chunk_elems)


def _delta_bytes(n: int, nbytes: int, transform: str, fraction: float, chunk_elems: int) -> int:
    """:func:`delta_transfer_bytes` of a transfer of ``n`` elements in ``nbytes`` bytes."""
    if n == 0 or fraction <= 0:
        return 0
    size = nbytes // n
    if transform == "fp8_block":
        blocks = -(-n // (FP8_BLOCK * FP8_BLOCK))
        k = fraction * blocks
        return int(min(nbytes, _align8(4 * k) + fraction * nbytes) + HEADER_BYTES)
    total = 0.0
    full, last = divmod(n, chunk_elems)
    lens = [chunk_elems] * full + ([last] if last else [])
    sparse = 0.0
    for m in lens:
        k = fraction * m
        c_sparse = 2 * k + k * size + 16
        c_other = min(_align8(-(-m // 8)) + k * size, m * size) + HEADER_BYTES
        if c_sparse <= c_other - HEADER_BYTES:
            sparse += c_sparse
        else:
            total += c_other
    if sparse:
        total += sparse + HEADER_BYTES
    return int(total)


def delta_plan(plan: Plan, fraction: float, chunk_elems: int = DELTA_CHUNK_ELEMS) -> Plan:
    """``plan`` with every transfer's bytes replaced by its expected delta size at ``fraction``
    (a stream header per (sender, receiver) link added to the link's first transfer)."""
    if not 0 <= fraction <= 1:
        raise ConfigError(f"delta fraction must be in [0, 1], got {fraction}")
    seen: set[tuple[int, int]] = set()
    out = []
    sizes: dict[tuple, int] = {}  # a plan repeats few transfer shapes (each expert, each replica)
    for t in plan.transfers:
        key = (box_numel(t.dst_box), t.nbytes, t.transform)
        nbytes = sizes.get(key)
        if nbytes is None:
            nbytes = sizes[key] = _delta_bytes(*key, fraction, chunk_elems)
        if (t.src_rank, t.dst_rank) not in seen:
            seen.add((t.src_rank, t.dst_rank))
            nbytes += HEADER_BYTES
        out.append(replace(t, nbytes=nbytes))
    return replace(plan, transfers=out, meta={**plan.meta, "delta_fraction": fraction})
