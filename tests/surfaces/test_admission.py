"""Run admission: `max_runs` execute, `max_queued_runs` wait queued, the rest get 503 at once."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from daemon.service import Daemon
from surfaces.http import HttpOptions, create_app
from tests.runs.model_server import ScriptedServer, roster_toml, settings_for

MAX_RUNS, MAX_QUEUED, SUBMITS = 4, 40, 2000


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


@pytest.fixture
async def session(tmp_path: Path) -> AsyncIterator[tuple[Daemon, aiohttp.ClientSession]]:
    """A daemon whose runs hang on a slow model (so they stay admitted), served on a socket."""
    server = ScriptedServer([("hang", "late", 60.0)], default="done")
    await server.start()
    roster = roster_toml(server.url, max_runs=MAX_RUNS, max_queued_runs=MAX_QUEUED)
    daemon = Daemon(settings_for(tmp_path, roster))
    await daemon.start()
    path = tmp_path / "tally.sock"
    runner = web.AppRunner(create_app(daemon, HttpOptions()))
    await runner.setup()
    await web.UnixSite(runner, str(path)).start()
    connector = aiohttp.UnixConnector(path=str(path), limit=64)
    async with aiohttp.ClientSession(connector=connector) as client:
        yield daemon, client
    for view in daemon.engine.list(limit=10_000):
        await daemon.engine.cancel(view.id)
    await runner.cleanup()
    await daemon.stop()
    await server.stop()


async def test_two_thousand_concurrent_submits_are_bounded(
    session: tuple[Daemon, aiohttp.ClientSession],
) -> None:
    daemon, client = session
    before = rss_kib()
    peak_active = 0

    async def submit(i: int) -> tuple[int, str | None]:
        nonlocal peak_active
        body = {"request": f"hang {i}", "lane": "backend"}
        async with client.post("http://tally/v1/tools/submit", json=body) as resp:
            await resp.read()
            peak_active = max(peak_active, daemon.engine.census.active())
            return resp.status, resp.headers.get("Retry-After")

    answers = await asyncio.wait_for(asyncio.gather(*(submit(i) for i in range(SUBMITS))), 120)
    statuses = Counter(status for status, _ in answers)
    assert statuses[200] == MAX_RUNS + MAX_QUEUED, statuses
    assert statuses[503] == SUBMITS - MAX_RUNS - MAX_QUEUED, statuses
    assert all(retry is not None and int(retry) >= 1 for s, retry in answers if s == 503)
    assert peak_active <= MAX_RUNS + MAX_QUEUED
    running = sum(1 for v in daemon.engine.list(limit=10_000) if v.state not in ("queued",))
    assert running <= MAX_RUNS
    async with client.get("http://tally/metrics") as resp:
        text = await resp.text()
    assert f"tally_run_queue_depth {MAX_QUEUED}" in text
    assert rss_kib() - before < 100 * 1024, "memory grew with the refused submits"
