"""PageAllocator: a free list of page ids with page 0 reserved."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radix_runtime.scheduler.allocator import PageAllocator


def test_fresh_allocator_hands_out_pages_from_one():
    alloc = PageAllocator(8)
    assert alloc.total_pages == 7 and alloc.free_pages == 7
    pages = alloc.alloc(3)
    assert pages.dtype == np.int32
    assert pages.tolist() == [1, 2, 3]
    assert alloc.free_pages == 4
    alloc.check_integrity()


def test_alloc_zero_and_exhaustion():
    alloc = PageAllocator(5)
    assert alloc.alloc(0).tolist() == []
    assert alloc.alloc(5) is None  # only 4 allocatable
    assert alloc.free_pages == 4  # a failed alloc takes nothing
    everything = alloc.alloc(4)
    assert sorted(everything.tolist()) == [1, 2, 3, 4]
    assert alloc.alloc(1) is None
    assert alloc.free_pages == 0
    with pytest.raises(ValueError):
        alloc.alloc(-1)


def test_free_returns_pages_lifo():
    alloc = PageAllocator(10)
    a = alloc.alloc(3)
    alloc.free(a[1:])
    assert alloc.free_pages == 8
    again = alloc.alloc(2)
    assert sorted(again.tolist()) == sorted(a[1:].tolist())
    alloc.free([int(a[0])])  # lists work too
    alloc.free(np.array([], dtype=np.int32))
    alloc.check_integrity()


@pytest.mark.parametrize(
    "bad, match",
    [
        ([0], "reserved"),
        ([10], "out-of-range"),
        ([-1], "out-of-range"),
        ([3], "double free"),  # page 3 is free
        ([1, 1], "twice in one call"),
    ],
)
def test_bad_free_raises_and_changes_nothing(bad, match):
    alloc = PageAllocator(10)
    alloc.alloc(2)  # pages 1 and 2 in use, 3..9 free
    before = alloc.free_page_ids()
    with pytest.raises(ValueError, match=match):
        alloc.free(bad)
    assert np.array_equal(alloc.free_page_ids(), before)
    alloc.check_integrity()


def test_double_free_after_free():
    alloc = PageAllocator(4)
    pages = alloc.alloc(2)
    alloc.free(pages)
    with pytest.raises(ValueError, match="double free"):
        alloc.free(pages)


def test_free_of_more_pages_than_are_in_use():
    alloc = PageAllocator(4)
    alloc.alloc(1)
    with pytest.raises(ValueError, match="in use"):
        alloc.free([1, 1, 1, 1, 1])
    assert alloc.free_pages == 2


def test_minimum_size():
    with pytest.raises(ValueError):
        PageAllocator(1)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 6)), max_size=60))
def test_allocator_matches_a_set_model(ops):
    alloc = PageAllocator(16)
    held: list[int] = []
    free_model = set(range(1, 16))
    for is_alloc, n in ops:
        if is_alloc:
            pages = alloc.alloc(n)
            if n > len(free_model):
                assert pages is None
            else:
                got = set(pages.tolist())
                assert len(got) == n and got <= free_model
                free_model -= got
                held.extend(got)
        elif held:
            k = min(n, len(held))
            give, held = held[:k], held[k:]
            alloc.free(give)
            free_model |= set(give)
        assert alloc.free_pages == len(free_model)
        assert set(alloc.free_page_ids().tolist()) == free_model
        alloc.check_integrity()
