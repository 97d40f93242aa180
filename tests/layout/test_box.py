"""Box arithmetic against torch indexing on real tensors: the planner's ground truth."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fastsync.layout.box import (
    box_numel,
    box_slices,
    chunk_bounds,
    contiguous_runs,
    even_bounds,
    flat_range_to_boxes,
    full_box,
    intersect,
    to_global,
    to_local,
)

shapes = st.lists(st.integers(1, 6), min_size=1, max_size=4).map(tuple)


@st.composite
def shape_and_box(draw):
    shape = draw(shapes)
    box = []
    for n in shape:
        a = draw(st.integers(0, n - 1))
        b = draw(st.integers(a + 1, n))
        box.append((a, b))
    return shape, tuple(box)


@settings(max_examples=150, deadline=None)
@given(shape_and_box())
def test_contiguous_runs_cover_exactly_the_box(sb):
    shape, box = sb
    t = torch.arange(math.prod(shape)).reshape(shape)
    want = t[box_slices(box)].flatten().tolist()
    flat = t.flatten()
    got = [x for off, n in contiguous_runs(box, shape) for x in flat[off : off + n].tolist()]
    assert got == want
    runs = contiguous_runs(box, shape)
    assert all(a[0] + a[1] < b[0] for a, b in zip(runs, runs[1:])), "adjacent runs must be merged"


@settings(max_examples=150, deadline=None)
@given(shapes, st.data())
def test_flat_range_to_boxes_reassembles_the_range(shape, data):
    total = math.prod(shape)
    start = data.draw(st.integers(0, total))
    stop = data.draw(st.integers(start, total))
    t = torch.arange(total).reshape(shape)
    boxes = flat_range_to_boxes(start, stop, shape)
    got = [x for b in boxes for x in t[box_slices(b)].flatten().tolist()]
    assert got == list(range(start, stop))
    assert sum(box_numel(b) for b in boxes) == stop - start


@pytest.mark.parametrize("size,n", [(384, 256), (10, 4), (3, 8), (0, 2), (8, 8)])
def test_chunk_bounds_matches_torch_chunk(size, n):
    chunks = torch.arange(size).chunk(n) if size else ()
    bounds = chunk_bounds(size, n)
    assert len(bounds) == n
    nonempty = [(s, e) for s, e in bounds if e > s]
    assert [(int(c[0]), int(c[-1]) + 1) for c in chunks] == nonempty


def test_even_bounds_refuses_uneven_split():
    assert even_bounds(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    with pytest.raises(ValueError, match="10 does not split evenly into 4"):
        even_bounds(10, 4)


def test_intersect_and_local_coordinates_round_trip():
    a = ((0, 4), (2, 6))
    b = ((2, 8), (0, 3))
    assert intersect(a, b) == ((2, 4), (2, 3))
    assert intersect(a, ((4, 5), (0, 6))) is None
    origin = ((2, 8), (0, 3))
    assert to_global(to_local(((2, 4), (2, 3)), origin), origin) == ((2, 4), (2, 3))
    assert full_box((3, 4)) == ((0, 3), (0, 4))
