"""Surfaces benchmark: HTTP `route` vs a bare aiohttp handler, MCP round trip, O(1) reads.

1. `route` over HTTP (witnessed, keep-alive, 32 concurrent clients, TCP + bearer token) vs a
   bare aiohttp hello-world handler served the same way in the same run: ratio of requests/s.
2. An MCP `route` call through the stdio adapter to the daemon: p50 / p95.
3. `/metrics` and `run_get` latency with a 1k-entry vs a 1M-entry ledger: ratio of medians.
   The ledgers are built with `daemon.ledger.bulk`, then the daemon starts on them (timed and
   reported, not part of the latency) and runs a few real requests before the measurement.

Everything is the real Daemon (ledger, engine, pool); its pool members are the fake
OpenAI-compatible model server of tests/slots (in-process), so model time is not measured.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from surfaces.http import HttpOptions, create_app
from tests.bench.table import print_rows

TOKEN = "bench-token"
CLIENTS = 32
SECONDS = 4.0
REPEATS = 3
ROOT = Path(__file__).resolve().parents[2]


@asynccontextmanager
async def served(app: web.Application) -> AsyncIterator[str]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


async def hammer(url: str, body: dict[str, Any], method: str = "POST") -> float:
    """Requests/s of CLIENTS keep-alive clients for SECONDS."""
    stop = time.perf_counter() + SECONDS
    count = 0
    headers = {"Authorization": f"Bearer {TOKEN}"}
    connector = aiohttp.TCPConnector(limit=CLIENTS)
    async with aiohttp.ClientSession(connector=connector, headers=headers) as session:

        async def client() -> None:
            nonlocal count
            while time.perf_counter() < stop:
                async with session.request(method, url, json=body) as resp:
                    await resp.read()
                    assert resp.status == 200, resp.status
                count += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(CLIENTS)))
        return count / (time.perf_counter() - t0)


def hello_app() -> web.Application:
    async def hello(request: web.Request) -> web.Response:
        await request.read()
        return web.json_response({"hello": "world"})

    app = web.Application()
    app.router.add_post("/hello", hello)
    return app


@asynccontextmanager
async def a_daemon(tmp: Path) -> AsyncIterator[tuple[Any, float]]:
    """The real Daemon on `tmp/state`, its members an in-process fake model server."""
    from daemon.service import Daemon
    from tests.slots.fake_server import FakeServer
    from tests.surfaces.conftest import daemon_settings

    model = FakeServer(slots=4)
    await model.start()
    daemon = Daemon(daemon_settings(tmp, model.url))
    t0 = time.perf_counter()
    await daemon.start()
    started_s = time.perf_counter() - t0
    try:
        yield daemon, started_s
    finally:
        await daemon.stop()
        await model.stop()


async def http_route(rows: list[tuple[str, str]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        async with a_daemon(Path(tmp)) as (daemon, _started_s):
            app = create_app(daemon, HttpOptions(token=TOKEN))
            ratios, routes, hellos = [], [], []
            async with served(app) as base, served(hello_app()) as hello:
                body = {"text": "the api server returns 500 on login"}
                for _ in range(REPEATS):
                    h = await hammer(f"{hello}/hello", {})
                    r = await hammer(f"{base}/v1/tools/route", body)
                    hellos.append(h)
                    routes.append(r)
                    ratios.append(r / h)
    rows.append(("route over HTTP, req/s (median)", f"{statistics.median(routes):.0f}"))
    rows.append(("bare aiohttp hello, req/s (median)", f"{statistics.median(hellos):.0f}"))
    rows.append(("route / hello ratio (median; target >= 0.6)", f"{statistics.median(ratios):.2f}"))


async def mcp_route(rows: list[tuple[str, str]]) -> None:
    from mcp import ClientSession, StdioServerParameters
    from mcp.client.stdio import stdio_client

    with tempfile.TemporaryDirectory() as tmp:
        sock = Path(tmp) / "tally.sock"
        async with a_daemon(Path(tmp)) as (daemon, _started_s):
            runner = web.AppRunner(create_app(daemon, HttpOptions()), access_log=None)
            await runner.setup()
            await web.UnixSite(runner, str(sock)).start()
            params = StdioServerParameters(
                command=sys.executable,
                args=["-m", "surfaces", "mcp"],
                env={"TALLY_SOCKET": str(sock)},
                cwd=str(ROOT),
            )
            times: list[float] = []
            try:
                async with (
                    stdio_client(params) as (read, write),
                    ClientSession(read, write) as session,
                ):
                    await session.initialize()
                    for i in range(220):
                        t0 = time.perf_counter()
                        result = await session.call_tool("route", {"text": f"fix the api {i}"})
                        if i >= 20:  # warm-up
                            times.append(time.perf_counter() - t0)
                        assert not result.is_error
            finally:
                await runner.cleanup()
    times.sort()
    p50 = statistics.median(times) * 1000
    p95 = times[int(len(times) * 0.95)] * 1000
    rows.append(("MCP route via adapter, p50 ms (target <= 5)", f"{p50:.2f}"))
    rows.append(("MCP route via adapter, p95 ms", f"{p95:.2f}"))


async def latency(fn: Callable[[], Awaitable[None]], n: int = 300) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        await fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


RUNS = 5


async def real_runs(daemon: Any, n: int = RUNS) -> list[str]:
    ids = []
    for i in range(n):
        view = await daemon.engine.submit(f"bench the api {i}")
        view = await daemon.engine.wait(view.id, timeout=60)
        assert view.state == "done", view.error
        ids.append(view.id)
    return ids


async def reads_vs_size(rows: list[tuple[str, str]], big: int) -> None:
    from daemon.ledger import bulk

    results: dict[int, tuple[float, float]] = {}
    for size in (1_000, big):
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            bulk.build(Path(tmp) / "state", size)
            build_s = time.perf_counter() - t0
            async with a_daemon(Path(tmp)) as (daemon, started_s):
                runs = await real_runs(daemon)
                app = create_app(daemon, HttpOptions(token=TOKEN))
                async with (
                    served(app) as base,
                    aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as s,
                ):

                    async def metrics() -> None:
                        async with s.get(f"{base}/metrics") as resp:
                            await resp.read()
                            assert resp.status == 200

                    async def run_get(run_id: str = runs[0]) -> None:
                        async with s.post(
                            f"{base}/v1/tools/run_get", json={"run_id": run_id}
                        ) as resp:
                            await resp.read()
                            assert resp.status == 200

                    await latency(metrics, 30)
                    await latency(run_get, 30)
                    results[size] = (await latency(metrics), await latency(run_get))
                entries = daemon.ledger.size
                rows.append(
                    (
                        f"{entries} entries ({RUNS} real runs): bulk build s, daemon start s",
                        f"{build_s:.1f}, {started_s:.2f}",
                    )
                )
    small, large = results[1_000], results[big]
    rows.append(("/metrics p50 ms, 1k entries", f"{small[0]:.2f}"))
    rows.append((f"/metrics p50 ms, {big} entries", f"{large[0]:.2f}"))
    rows.append(("run_get p50 ms, 1k entries", f"{small[1]:.2f}"))
    rows.append((f"run_get p50 ms, {big} entries", f"{large[1]:.2f}"))
    rows.append(
        (
            "large/small ratio metrics, run_get (target <= 1.2)",
            f"{large[0] / small[0]:.2f}, {large[1] / small[1]:.2f}",
        )
    )


def main() -> None:
    import os

    big = int(os.environ.get("TALLY_BENCH_BIG", "1000000"))
    rows: list[tuple[str, str]] = []
    asyncio.run(http_route(rows))
    asyncio.run(mcp_route(rows))
    asyncio.run(reads_vs_size(rows, big))
    print_rows(rows)


if __name__ == "__main__":
    main()
