"""The soak: a real daemon serving many runs while readers hammer the record.

Shared by `tests/runs/test_soak.py` (a short one, in the suite) and `tests/bench/bench_soak.py`
(5,000 runs, in `make bench`). Runs are sandboxed command tasks that print 64 KiB each, so the
body pack and its table grow the whole time. Halfway through, while runs keep going: 20 SSE
clients replay the backlogs of finished runs, `ledger_summary` reads the whole ledger, and a
body is redacted. All along, a probe times `GET /healthz` over the daemon's unix socket and a
monitor records how late the event loop wakes it. RSS and the snapshot's cost are taken after
the first `early` runs and again at the end.
"""

from __future__ import annotations

import asyncio
import gc
import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from daemon.runs import snapshot as snapshots
from daemon.service import Daemon
from surfaces.cli.memory import settled
from surfaces.http import HttpOptions, create_app
from tests.runs.model_server import ScriptedServer, roster_toml, settings_for

OUTPUT = 64 * 1024


def _print_64k(n: int) -> list[str]:
    """A command that prints 64 KiB, distinct per run (so every body is a new one)."""
    return ["sh", "-c", f"echo run {n}; head -c {OUTPUT} /dev/zero | tr '\\0' x"]


@dataclass
class Sample:
    """What the daemon costs after `runs` runs."""

    runs: int
    rss_bytes: int
    snapshot_loop_s: float
    """The event loop's share of writing a snapshot (taking the views, stamping)."""
    snapshot_total_s: float
    """The whole write, worker thread included."""
    views: int


@dataclass
class SoakResult:
    runs: int
    wall_s: float
    samples: list[Sample] = field(default_factory=list)
    healthz_s: list[float] = field(default_factory=list)
    lag_worst_s: float = 0.0
    summary_s: float = 0.0
    summary_entries: int = 0
    sse_events: int = 0
    redacted: bool = False
    failed_runs: int = 0
    table_slots: tuple[int, int] = (0, 0)


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _Lag:
    """How late the loop wakes a task that sleeps `interval_s` (the worst seen)."""

    def __init__(self, interval_s: float = 0.005) -> None:
        self.interval_s = interval_s
        self.worst = 0.0
        self.paused = False
        """While the soak itself blocks the loop to measure (gc.collect, a timed snapshot)."""

    async def watch(self) -> None:
        while True:
            asked = time.monotonic()
            await asyncio.sleep(self.interval_s)
            if not self.paused:
                self.worst = max(self.worst, time.monotonic() - asked - self.interval_s)


async def _probe(session: aiohttp.ClientSession, latencies: list[float], lag: _Lag) -> None:
    while True:
        start = time.perf_counter()
        async with session.get("http://tally/healthz") as reply:
            await reply.read()
        if not lag.paused:
            latencies.append(time.perf_counter() - start)
        await asyncio.sleep(0.02)


def _plan(n: int) -> dict[str, Any]:
    task = {"id": "t", "lane": "backend", "instruction": "print 64 KiB", "executor": "command"}
    return {"tasks": [task | {"argv": _print_64k(n)}]}


async def _sample(daemon: Daemon, finished: list[str]) -> Sample:
    gc.collect()
    runs = len(finished)
    start = time.perf_counter()
    taken = daemon.engine.snapshot()
    snapshots.stamp(daemon.ledger, taken[0], taken[1])
    loop_s = time.perf_counter() - start
    daemon._snapshot_size = -1  # write even if nothing changed since the last one
    start = time.perf_counter()
    await daemon.write_snapshot()
    total_s = time.perf_counter() - start
    return Sample(runs, rss_bytes(), loop_s, total_s, len(taken[1]) + len(taken[2]))


async def _readers(
    daemon: Daemon, session: aiohttp.ClientSession, finished: list[str], result: SoakResult
) -> None:
    """20 SSE backlog replays, a whole-ledger summary and a redaction, at once."""
    rng = random.Random(11)

    async def replay(run_id: str) -> int:
        async with session.get(f"http://tally/v1/runs/{run_id}/events") as reply:
            body = await reply.read()
        return body.count(b"\nevent: ") + body.startswith(b"event: ")

    async def summary() -> None:
        start = time.perf_counter()
        async with session.post("http://tally/v1/tools/ledger_summary", json={}) as reply:
            data = await reply.json()
        result.summary_s = time.perf_counter() - start
        result.summary_entries = int(data.get("entries", 0))

    async def redact() -> None:
        first = await daemon.ledger.entries(start=0, limit=1, kind="command.run")
        if first and first[0].body:
            await daemon.ledger.redact(first[0].body, actor="soak", reason="soak redaction")
            result.redacted = (await daemon.ledger.body(first[0].body)).state == "redacted"

    picked = [rng.choice(finished) for _ in range(20)]
    counts = await asyncio.gather(*(replay(r) for r in picked), summary(), redact())
    result.sse_events = sum(c for c in counts if isinstance(c, int))


async def soak(tmp: Path, runs: int, early: int, concurrency: int = 8, **policy: Any) -> SoakResult:
    """`policy`: `[policy]` keys for the roster (`keep_runs`, `keep_summaries`). A new body
    table starts at `stores.INITIAL_SLOTS` slots (a test lowers it to see the table grow)."""
    server = ScriptedServer([], default="done")
    await server.start()
    settings = settings_for(tmp, roster_toml(server.url, max_runs=concurrency, **policy))
    daemon = Daemon(settings)
    await daemon.start()
    settled()  # as `tally serve` does once started: start-up's objects leave the collections
    sock = tmp / "soak.sock"
    runner = web.AppRunner(create_app(daemon, HttpOptions(keepalive_s=0.2)))
    await runner.setup()
    await web.UnixSite(runner, str(sock)).start()
    connector = aiohttp.UnixConnector(path=str(sock), limit=64)
    session = aiohttp.ClientSession(connector=connector)
    result = SoakResult(runs=runs, wall_s=0.0)
    result.table_slots = (daemon.ledger.bodies.slots, 0)
    lag = _Lag()
    background = [
        asyncio.create_task(lag.watch()),
        asyncio.create_task(_probe(session, result.healthz_s, lag)),
    ]
    finished: list[str] = []
    next_run = 0
    readers: asyncio.Task[None] | None = None
    started = time.perf_counter()

    async def worker() -> None:
        nonlocal next_run
        while next_run < runs:
            next_run += 1
            view = await daemon.engine.submit(f"backend soak {next_run}", plan=_plan(next_run))
            done = await daemon.engine.wait(view.id, timeout=120)
            if done.state != "done":
                result.failed_runs += 1
            finished.append(view.id)

    try:
        workers = [asyncio.create_task(worker()) for _ in range(concurrency)]
        while len(finished) < early:
            await asyncio.sleep(0.05)
        lag.paused = True
        result.samples.append(await _sample(daemon, finished))
        await asyncio.sleep(0.05)  # the probes in flight while paused
        lag.paused = False
        while len(finished) < runs // 2:
            await asyncio.sleep(0.05)
        readers = asyncio.create_task(_readers(daemon, session, list(finished), result))
        await asyncio.gather(*workers)
        await readers
        result.wall_s = time.perf_counter() - started
        result.lag_worst_s = lag.worst
        lag.paused = True
        result.samples.append(await _sample(daemon, finished))
        result.table_slots = (result.table_slots[0], daemon.ledger.bodies.slots)
    finally:
        for task in background:
            task.cancel()
        # A probe cancelled inside aiohttp may end in aiohttp's own error: either is its end.
        await asyncio.gather(*background, return_exceptions=True)
        await session.close()
        await runner.cleanup()
        await daemon.stop()
        await server.stop()
    return result
