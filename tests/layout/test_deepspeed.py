"""DeepSpeed layouts read from a live module's ``ds_*`` attributes (``fastsync.deepspeed_layout``):
ZeRO-3's flat partitions, whole parameters below stage 3, refusals naming parameter and rank. The
module is a real torch module whose parameters carry the attributes ZeRO-3 gives them (a stand-in
for DeepSpeed, which does not partition on CPU here)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from fastsync import ConfigError, LayoutError, deepspeed_layout, zero3_sources


def _zero3(module: torch.nn.Module, rank: int, world: int) -> None:
    """Give every parameter ZeRO-3's attributes: its flat slice of ceil(n/world), zero-padded."""
    for p in module.parameters():
        n, per = p.numel(), -(-p.numel() // world)
        flat = torch.zeros(per * world, dtype=p.dtype)
        flat[:n] = p.detach().reshape(-1)
        p.ds_shape, p.ds_numel, p.ds_tensor = p.shape, n, flat[rank * per:(rank + 1) * per].clone()


def test_zero3_layout_and_sources_are_the_flat_partitions() -> None:
    m = torch.nn.Linear(7, 5)  # 35 + 5 elements: neither divides by 3
    _zero3(m, rank=2, world=3)
    layout, sources = deepspeed_layout(m, 2, 3, zero_stage=3)
    assert layout.world_size == 3 and set(layout.params) == {"weight", "bias"}
    assert layout.params["weight"].shape == (5, 7)
    assert sources["weight"].numel() == 12 and sources["weight"].data_ptr() == m.weight.ds_tensor.data_ptr()
    assert torch.equal(sources["weight"][:11], m.weight.detach().reshape(-1)[24:])  # the last rank's, padded


def test_below_stage_3_every_rank_holds_the_whole_parameters() -> None:
    m = torch.nn.Linear(7, 5)
    layout, sources = deepspeed_layout(m, 1, 2, zero_stage=2)
    assert layout.world_size == 2 and sources["bias"].data_ptr() == m.bias.data_ptr()
    assert {s.rank for s in layout.shards["weight"]} == {0, 1}
    with pytest.raises(ConfigError, match="ZeRO stage must be 0-3, got 4"):
        deepspeed_layout(m, 0, 2, zero_stage=4)


def test_partition_that_is_not_zero3_flat_layout_is_refused_by_name() -> None:
    good = SimpleNamespace(ds_tensor=torch.zeros(5), ds_numel=9)  # ceil(9/2) = 5, last rank padded
    assert zero3_sources({"a.weight": good}, rank=1, world_size=2)["a.weight"].numel() == 5
    bad = SimpleNamespace(ds_tensor=torch.zeros(4), ds_numel=9)
    with pytest.raises(LayoutError, match=r"rank 1: parameter 'b.weight'"):
        zero3_sources({"b.weight": bad}, rank=1, world_size=2)
    with pytest.raises(LayoutError, match="not a ZeRO-3 parameter"):
        zero3_sources({"c.weight": SimpleNamespace()}, rank=0, world_size=2)
