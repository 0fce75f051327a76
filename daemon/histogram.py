"""A Prometheus-style histogram kept in memory: counts per upper bound, a sum and a count."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
"""Bounds for durations from milliseconds to minutes."""


@dataclass
class Histogram:
    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def observe(self, value: float) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)
        self.counts[bisect.bisect_left(self.bounds, value)] += 1  # value <= bound
        self.total += value
        self.n += 1

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations <= it), ending with +Inf, as Prometheus wants."""
        counts = self.counts or [0] * (len(self.bounds) + 1)
        out, running = [], 0
        for bound, count in zip((*self.bounds, float("inf")), counts, strict=True):
            running += count
            out.append((bound, running))
        return out
