"""Runs of consecutive ids: how the host tier's copies group pages (one copy per run of
consecutive host pages; the worker copies them, the scheduler counts them)."""

from __future__ import annotations

import numpy as np


def consecutive_runs(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Where the runs of consecutive ids (each one more than the one before) start in `ids`,
    and how long they are."""
    if len(ids) == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    starts = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = np.concatenate(([0], starts))
    return starts, np.diff(np.concatenate((starts, [len(ids)])))
