"""The command sandbox's cost per task: bubblewrap versus a bare spawn of the same argv.

Both go through `daemon.runs.executors.run_command` (temp dir, capped pipes, process group,
cleanup off the loop); only the policy differs (`sandbox = "none"` vs `"bwrap"`), measured
interleaved, round by round, in one process. Target: ≤ 15 ms added at p50.
"""

from __future__ import annotations

import asyncio
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from daemon.runs.executors import run_command
from daemon.runs.sandbox import Confinement
from roster.models import CommandPolicy

ROUNDS = 60
ARGV = ["/bin/true"]


async def _once(policy: CommandPolicy, confinement: Confinement) -> float:
    started = time.perf_counter()
    outcome = await run_command(ARGV, policy=policy, confinement=confinement, timeout_s=10)
    assert outcome.exit_code == 0, outcome.stderr
    return time.perf_counter() - started


async def _measure() -> tuple[list[float], list[float]]:
    root = Path(tempfile.mkdtemp(prefix="tally-bench-sandbox-"))
    confinement = Confinement(hidden=(root / "state",), tasks_root=root / "tasks")
    bare, boxed = CommandPolicy(sandbox="none"), CommandPolicy(sandbox="bwrap")
    bare_s: list[float] = []
    boxed_s: list[float] = []
    try:
        for _ in range(5):  # warm the page cache and the allocator
            await _once(bare, confinement)
            await _once(boxed, confinement)
        for _ in range(ROUNDS):
            bare_s.append(await _once(bare, confinement))
            boxed_s.append(await _once(boxed, confinement))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return bare_s, boxed_s


def main() -> None:
    if shutil.which("bwrap") is None:
        print("bwrap not installed: skipped (make install installs bubblewrap)")
        return
    bare, boxed = asyncio.run(_measure())
    bare_p50 = statistics.median(bare) * 1000
    boxed_p50 = statistics.median(boxed) * 1000
    added = statistics.median(b - a for a, b in zip(bare, boxed, strict=True)) * 1000
    print(f"{ROUNDS} rounds of `{' '.join(ARGV)}` as a command task, interleaved\n")
    print("| measure | p50 ms | target |")
    print("|---|---|---|")
    print(f"| bare spawn (sandbox = none, same rlimits) | {bare_p50:.2f} | reference |")
    print(f"| bubblewrap sandbox | {boxed_p50:.2f} | |")
    print(f"| added by the sandbox (median of per-round differences) | {added:.2f} | ≤ 15 |")
    print(f"| ratio sandbox / bare | {boxed_p50 / bare_p50:.2f} | |")
