"""Run admission's cost on the submit path: witnessed submits through the real Daemon (file
ledger, fsync on), with the admission check as shipped versus the check bypassed, in rounds
interleaved in one process. `route` does not go through admission at all (only submit and
resume do), so this is the path whose cost could change. Target: unchanged within noise.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from daemon.runs.executors import echo_stub
from daemon.service import Daemon
from tests.runs.model_server import ScriptedServer, roster_toml, settings_for

ROUNDS = 8
SUBMITS = 200
PLAN = {"tasks": [{"id": "t", "lane": "backend", "instruction": "x"}]}  # answered by echo_stub


async def _round(daemon: Daemon) -> float:
    started = time.perf_counter()
    views = await asyncio.gather(
        *(daemon.engine.submit(f"r{i}", plan=PLAN) for i in range(SUBMITS))
    )
    elapsed = time.perf_counter() - started
    for view in views:
        await daemon.engine.wait(view.id, timeout=60)
    return SUBMITS / elapsed


async def _measure() -> tuple[list[float], list[float]]:
    server = ScriptedServer([], default="done")
    await server.start()
    with tempfile.TemporaryDirectory(prefix="tally-bench-admission-") as tmp:
        roster = roster_toml(server.url, max_runs=4096, max_queued_runs=4096)
        daemon = Daemon(settings_for(Path(tmp), roster))
        await daemon.start()
        daemon.engine.setting.stub = echo_stub  # the tasks answer their instruction, no model
        checked: list[float] = []
        bypassed: list[float] = []
        admit = daemon.engine._admit
        try:
            await _round(daemon)  # warm-up
            for n in range(ROUNDS):
                for bypass in (n % 2 == 1, n % 2 == 0):  # alternate which goes first
                    daemon.engine._admit = (lambda: None) if bypass else admit  # type: ignore[method-assign]
                    (bypassed if bypass else checked).append(await _round(daemon))
                daemon.engine._admit = admit  # type: ignore[method-assign]
        finally:
            await daemon.stop()
            await server.stop()
    return checked, bypassed


def main() -> None:
    checked, bypassed = asyncio.run(_measure())
    ratios = [a / b for a, b in zip(checked, bypassed, strict=True)]
    print(f"{ROUNDS} interleaved rounds of {SUBMITS} concurrent witnessed submits\n")
    print("| measure | submits/s (median) | target |")
    print("|---|---|---|")
    print(f"| admission bypassed (reference) | {statistics.median(bypassed):,.0f} | |")
    print(f"| admission as shipped | {statistics.median(checked):,.0f} | |")
    print(f"| ratio (median of per-round ratios) | {statistics.median(ratios):.3f} | ≈ 1.0 |")
