"""``fastsync.executor.arena.carve``: views start at multiples of the alignment, do not overlap,
cover exactly the bytes asked; a large enough uint8 arena is reused, a small one replaced."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from fastsync.executor.arena import arena_bytes, carve, nbytes_of  # noqa: E402


def test_views_are_aligned_disjoint_and_exact():
    spans = [("a", 3), ("b", 0), ("c", 70), ("d", 65)]
    arena, views = carve(None, spans, align=64)
    assert arena.dtype == torch.uint8 and arena.numel() == arena_bytes([n for _, n in spans], 64) == 64 + 128 + 128
    assert [views[k].numel() for k, _ in spans] == [3, 0, 70, 65]
    starts = [views[k].data_ptr() - arena.data_ptr() for k in ("a", "c", "d")]
    assert starts == [0, 64, 192] and all(s % 64 == 0 for s in starts)
    for i, k in enumerate(("a", "c", "d")):
        views[k].fill_(i + 1)
    assert int((arena == 1).sum()) == 3 and int((arena == 2).sum()) == 70 and int((arena == 3).sum()) == 65


def test_reuses_a_large_enough_arena_and_replaces_a_small_one():
    old = torch.full((100,), 7, dtype=torch.uint8)
    same, views = carve(old, [("x", 40), ("y", 60)])
    assert same is old and views["y"].data_ptr() == old.data_ptr() + 40
    new, _ = carve(old, [("x", 101)])
    assert new is not old and new.numel() == 101 and int(new.sum()) == 0  # a fresh, zeroed (touched) arena
    empty, none = carve(None, [])
    assert empty.numel() == 1 and none == {}


def test_nbytes_of_counts_awkward_shapes():
    assert nbytes_of((7, 13), torch.bfloat16) == 182 and nbytes_of((), torch.float32) == 4


def test_typed_views_have_their_shape_and_dtype_on_cache_lines():
    from fastsync.executor.arena import CACHE_LINE, carve_typed

    specs = [("w", (7, 13), torch.bfloat16), ("b", (5,), torch.float32), ("e", (0,), torch.float16),
             ("i", (2, 3), torch.int64)]
    arena, views = carve_typed(None, specs)
    for key, shape, dtype in specs:
        assert views[key].shape == shape and views[key].dtype == dtype, key
        assert (views[key].data_ptr() - arena.data_ptr()) % CACHE_LINE == 0, key
    views["w"].fill_(1)
    views["i"].fill_(3)
    assert float(views["w"].sum()) == 91 and int(views["b"].sum()) == 0 and int(views["i"].sum()) == 18


def test_an_arena_is_reused_only_on_the_device_asked_for():
    old = torch.zeros(100, dtype=torch.uint8)
    same, _ = carve(old, [("x", 40)], device="cpu")
    assert same is old
    fresh, _ = carve(None, [("x", 40)], align=8, device=torch.device("cpu"))
    assert fresh.device.type == "cpu" and fresh.numel() == 40
