"""Fixed-bucket histograms, as Prometheus keeps them: a count per bucket and a sum.

The scheduler counts its observations (queue time, step time, batch size...) into these and
ships the increments to the HTTP process (`messages.SchedulerMetrics`), which adds them to its
own copies and exposes every histogram through prometheus-client. The bucket bounds live here,
once, so both processes agree on them.
"""

from __future__ import annotations

from bisect import bisect_left

# upper bounds ("le"); a last bucket (+Inf) is implied
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                   1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)  # fmt: skip
INTER_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04,
                       0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)  # fmt: skip
STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.03,
                0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)  # fmt: skip
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
STEP_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


class Histogram:
    """Counts per bucket (`counts[i]`: observations in (bounds[i-1], bounds[i]], the last one
    past every bound) and their sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def add(self, counts: list[int], total: float) -> None:
        """Add another histogram's increments (same bounds)."""
        if len(counts) != len(self.counts):
            raise ValueError(f"{len(counts)} buckets, expected {len(self.counts)}")
        for i, c in enumerate(counts):
            self.counts[i] += c
        self.sum += total

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[int]:
        out, running = [], 0
        for c in self.counts:
            running += c
            out.append(running)
        return out

    def clear(self) -> None:
        self.counts = [0] * len(self.counts)
        self.sum = 0.0
