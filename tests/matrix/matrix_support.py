"""The sync matrix's cells and its checks, shared by every entry point's matrix test (not a test
module; issue 21 "Must show").

Every entry point (``WeightSync`` with live vLLM engines, the verl backend, the OpenRLHF adapter,
``fastsync bench``) runs the same four cells: the payload, ``dense`` or ``delta`` (a dense first
sync, then a sparse step sent as a delta), times the route, ``direct`` (every replica written by
the trainer ranks) or ``relayed`` (the first replica written by the trainers, the second fed by a
relay between engine ranks). Relays need at least two identical replicas, so every entry point
runs two. A cell an entry point cannot run today is an ``xfail(strict=True)`` naming what is
missing: it fails loudly the day it works.
"""

from __future__ import annotations

from typing import Any

#: (payload, route) of every cell, in the order the tests run them
CELLS: list[tuple[str, str]] = [("dense", "direct"), ("dense", "relayed"), ("delta", "direct"), ("delta", "relayed")]

#: the ``fanout`` option that asks for each route with two identical replicas
FANOUT = {"direct": "direct", "relayed": "chain"}



def cell_id(cell: tuple[str, str]) -> str:
    return f"{cell[0]}-{cell[1]}"


def cell_params() -> list[Any]:
    """The cells as pytest params."""
    import pytest

    return [pytest.param(cell, id=cell_id(cell)) for cell in CELLS]


def first_version(cell: tuple[str, str]) -> int:
    """Versions only grow on a shared engine: each cell gets its own block of ten."""
    return 10 * (CELLS.index(cell) + 1)


def reference_digest(full: dict[str, Any], tensors_json: dict) -> dict[str, str]:
    """What ``fastsync_digest`` must report for one engine rank whose tensors are ``tensors_json``
    (its ``describe()`` answer): a SHA-256 (16 hex digits) of each engine tensor's plain bytes,
    built piece by piece from the trainer's full weights (``fastsync.bench.local``)."""
    from fastsync.bench.local import reference_digests

    return reference_digests(full, tensors_json)


def assert_digest(got: dict[str, str], want: dict[str, str], what: str) -> None:
    assert set(got) == set(want), f"{what}: engine tensors {sorted(set(got) ^ set(want))[:5]} on one side only"
    differ = sorted(n for n in want if got[n] != want[n])
    assert not differ, f"{what}: engine bytes differ from the trainer's for {len(differ)} tensors, e.g. {differ[:5]}"


def sparse_step(full: dict[str, Any], seed: int, frac: float) -> None:
    """Change a fraction ``frac`` of every tensor's elements in place (a delta-sized step)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in full.values():
            mask = torch.rand(t.shape, generator=g) < frac
            t[mask] += torch.randn(int(mask.sum()), generator=g, dtype=t.dtype) * 0.3 * (t.std() + 1e-3)


#: prompts inside the MoE model's vocabulary (211; preset ``awkward-qwen3-moe``)
MOE_PROMPTS: list[list[int]] = [[5, 6, 7, 8], [100, 200, 150], [11, 42, 99, 7, 123], [210, 3, 77]]
