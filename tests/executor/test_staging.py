"""Landing regions: where writes land, and how a flip or a rollback reaches the live tensors."""

from __future__ import annotations

import pytest
import torch

from fastsync.errors import ConfigError
from fastsync.executor.staging import Landing, alloc_touched, as_bytes


def _live() -> dict[str, torch.Tensor]:
    return {
        "a": torch.arange(12, dtype=torch.float32).view(3, 4),
        "b": torch.arange(6, dtype=torch.bfloat16),
        "t": torch.arange(8, dtype=torch.float32).view(2, 4).t(),  # not contiguous
    }


def test_shadow_mode_never_touches_live_until_apply() -> None:
    live = _live()
    keep = {n: t.clone() for n, t in live.items()}
    ptrs = {n: t.data_ptr() for n, t in live.items()}
    land = Landing(live, mode="shadow")
    for n in live:
        land.regions[n].fill_(7)
    assert all(torch.equal(live[n], keep[n]) for n in live)
    assert land.rollback() and all(torch.equal(live[n], keep[n]) for n in live)
    for n in live:
        land.regions[n].fill_(7)
    land.apply()
    for n, t in live.items():
        assert t.data_ptr() == ptrs[n]  # same memory, new values
        assert bool((as_bytes(t.contiguous()) == 7).all())


def test_inplace_mode_writes_live_memory_and_stages_only_non_contiguous() -> None:
    live = _live()
    land = Landing(live, mode="inplace")
    assert land.staged == ["t"]
    assert land.regions["a"].data_ptr() == live["a"].data_ptr()
    land.regions["a"].zero_()
    assert not live["a"].any()
    land.view("t").copy_(torch.full((4, 2), 3.0))
    assert not torch.equal(live["t"], torch.full((4, 2), 3.0))
    land.apply()
    assert torch.equal(live["t"], torch.full((4, 2), 3.0))


def test_inplace_backup_restores_the_last_complete_version() -> None:
    live = _live()
    keep = {n: t.clone() for n, t in live.items()}
    land = Landing(live, mode="inplace", backup=True)
    assert not land.backup_fresh
    land.begin()  # refreshes the backup itself when the caller did not
    assert land.backup_fresh
    land.regions["a"].fill_(1)
    land.regions["b"].fill_(1)
    assert land.rollback()
    assert all(torch.equal(live[n], keep[n]) for n in live)
    land.regions["a"].fill_(2)
    land.apply()  # a successful flip makes the backup stale until refreshed
    assert not land.backup_fresh
    land.refresh_backup()
    land.regions["a"].fill_(5)
    land.rollback()
    assert bool((as_bytes(live["a"]) == 2).all())


def test_inplace_without_backup_reports_torn_tensors() -> None:
    land = Landing(_live(), mode="inplace")
    assert land.rollback() is False and land.torn


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ConfigError, match="mode"):
        Landing(_live(), mode="swap")
    with pytest.raises(ConfigError, match="backup"):
        Landing(_live(), mode="shadow", backup=True)


def test_alloc_touched_is_zeroed() -> None:
    buf = alloc_touched(1 << 16)
    assert buf.numel() == 1 << 16 and not buf.any()
