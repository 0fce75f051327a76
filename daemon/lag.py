"""Event-loop lag: how late the loop wakes a task that asked to sleep a fixed interval.

Everything the daemon serves runs on one event loop, so a handler that blocks it (a file read,
a big encode) delays every other request. A monitor task sleeps INTERVAL_S at a time and
records how much later than asked it woke: a histogram for /metrics
(`tally_event_loop_lag_seconds`) and the worst lag of the last WINDOW_S for `health`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time

from daemon.histogram import Histogram

INTERVAL_S = 0.1
WINDOW_S = 60.0
BOUNDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class LoopLag:
    def __init__(self, interval_s: float = INTERVAL_S) -> None:
        self.interval_s = interval_s
        self.histogram = Histogram(BOUNDS)
        self._recent: collections.deque[tuple[float, float]] = collections.deque()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._watch(), name="loop lag")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def observe(self, lag: float, now: float) -> None:
        self.histogram.observe(lag)
        recent = self._recent
        while recent and recent[0][0] < now - WINDOW_S:
            recent.popleft()
        # keep only lags that can still be the worst: a later, larger one outranks older ones
        while recent and recent[-1][1] <= lag:
            recent.pop()
        recent.append((now, lag))

    def worst(self) -> float:
        """The largest lag seen in the last WINDOW_S seconds."""
        now = time.monotonic()
        live = [lag for at, lag in self._recent if at >= now - WINDOW_S]
        return max(live, default=0.0)

    async def _watch(self) -> None:
        while True:
            asked = time.monotonic()
            await asyncio.sleep(self.interval_s)
            now = time.monotonic()
            self.observe(max(0.0, now - asked - self.interval_s), now)
