"""The event-loop lag monitor sees a blocked loop, and keeps only the last minute's worst."""

from __future__ import annotations

import asyncio
import time

from daemon.lag import WINDOW_S, LoopLag


async def test_a_blocked_loop_shows_as_lag() -> None:
    lag = LoopLag(interval_s=0.01)
    lag.start()
    try:
        await asyncio.sleep(0.05)
        time.sleep(0.12)  # noqa: ASYNC251 - the point: block the loop
        await asyncio.sleep(0.05)
    finally:
        await lag.stop()
    assert lag.worst() >= 0.1
    assert lag.histogram.n >= 3
    assert lag.histogram.cumulative()[-1][1] == lag.histogram.n


def test_the_worst_lag_is_forgotten_after_the_window() -> None:
    lag = LoopLag()
    now = time.monotonic()
    lag.observe(0.5, now - WINDOW_S - 1)  # long ago
    lag.observe(0.02, now)
    assert lag.worst() == 0.02
    lag.observe(0.01, now)
    assert lag.worst() == 0.02
