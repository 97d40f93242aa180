"""A DeepSpeed module describes itself (``fastsync_trainer_layout``, ``local_sources``): ZeRO-3's flat
partitions of each ``ds_shape``, whole parameters below stage 3, refusals naming parameter and rank.
The module is a real torch module whose parameters carry the attributes ZeRO-3 gives them (a
stand-in for DeepSpeed's ``zero.Init``; real DeepSpeed runs in tests/adapters and tests/matrix)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fastsync import LayoutError, local_sources, zero3_sources
from fastsync.plugins import hook


def _zero3(module: torch.nn.Module, rank: int, world: int) -> None:
    """Give every parameter ZeRO-3's attributes: its flat slice of ceil(n/world), zero-padded, and
    an empty placeholder where the whole tensor was (as zero.Init leaves it)."""
    for p in module.parameters():
        n, per = p.numel(), -(-p.numel() // world)
        flat = torch.zeros(per * world, dtype=p.dtype)
        flat[:n] = p.detach().reshape(-1)
        p.ds_shape, p.ds_numel, p.ds_tensor = p.shape, n, flat[rank * per:(rank + 1) * per].clone()
        p.data = torch.empty(0, dtype=p.dtype)


def test_zero3_module_describes_its_flat_partitions_and_sends_from_them() -> None:
    torch.manual_seed(0)
    m = torch.nn.Linear(7, 5)  # 35 + 5 elements: neither divides by 3
    full = m.weight.detach().reshape(-1).clone()
    _zero3(m, rank=2, world=3)
    layout = hook().fastsync_trainer_layout(model=m, rank=2, world_size=3)
    assert layout.kind == "zero3" and layout.world_size == 3
    assert layout.params["weight"].shape == (5, 7) and set(layout.params) == {"weight", "bias"}
    mine = layout.shards_on(2)
    src = local_sources(m, list(mine), rank=2, world_size=3)
    assert src["weight"].data_ptr() == m.weight.ds_tensor.data_ptr()  # the partition itself, no copy
    held = sum((b[0][1] - b[0][0]) * (b[1][1] - b[1][0]) for b in (sh.box for sh in mine["weight"]))
    assert held == 11 and [sh.local_offset for sh in mine["weight"]] == [0, 4]  # rows 3 (elements 3-6) and 4, flat
    assert torch.equal(src["weight"][:11], full[24:])  # the last rank's 11 elements, then padding


def test_below_stage_3_every_rank_holds_the_whole_parameters() -> None:
    m = torch.nn.Linear(7, 5)
    layout = hook().fastsync_trainer_layout(model=m, rank=1, world_size=2)
    assert layout.kind == "plain" and {s.rank for s in layout.shards["weight"]} == {0, 1}
    assert local_sources(m, ["bias"], rank=1, world_size=2)["bias"].data_ptr() == m.bias.data_ptr()


def test_partition_that_is_not_zero3_flat_layout_is_refused_by_name() -> None:
    good = SimpleNamespace(ds_tensor=torch.zeros(5), ds_numel=9)  # ceil(9/2) = 5, last rank padded
    assert zero3_sources({"a.weight": good}, rank=1, world_size=2)["a.weight"].numel() == 5
    bad = SimpleNamespace(ds_tensor=torch.zeros(4), ds_numel=9)
    with pytest.raises(LayoutError, match=r"rank 1: parameter 'b.weight'"):
        zero3_sources({"b.weight": bad}, rank=1, world_size=2)
    with pytest.raises(LayoutError, match="not a ZeRO-3 parameter"):
        zero3_sources({"c.weight": SimpleNamespace()}, rank=0, world_size=2)
