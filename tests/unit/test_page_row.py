"""PageRow: a request's page ids in a doubling int32 buffer, sliced as numpy views."""

from __future__ import annotations

import numpy as np
import pytest

from radix_runtime.scheduler.request import PageRow


def test_grows_and_keeps_order():
    row = PageRow()
    assert not row and len(row) == 0 and row.view().dtype == np.int32
    expected = []
    for i in range(1, 100):
        if i % 7:
            row.append(i)
            expected.append(i)
        else:
            row.extend(np.array([i, i + 1000], dtype=np.int64))
            expected += [i, i + 1000]
    assert row and len(row) == len(expected)
    assert row.view().tolist() == expected == list(row)
    assert row == expected


def test_slices_are_views_and_assignable():
    row = PageRow([5, 6, 7, 8])
    tail = row[2:]
    assert tail.tolist() == [7, 8]
    row[1:3] = np.array([60, 70])
    assert row.view().tolist() == [5, 60, 70, 8]
    assert tail.tolist() == [70, 8]  # a view: whoever keeps a slice copies it
    assert np.asarray(row).tolist() == [5, 60, 70, 8]
    assert np.asarray(row, dtype=np.int64).dtype == np.int64
    assert row[-1] == 8


def test_a_view_taken_before_growth_keeps_its_values():
    row = PageRow(range(1, 17))
    head = row[:4]
    for p in range(100, 200):  # forces reallocation
        row.append(p)
    assert head.tolist() == [1, 2, 3, 4] and len(row) == 116


def test_rejects_nothing_silently():
    with pytest.raises(ValueError):
        PageRow([1, 2]).extend(np.array(["x"]))
