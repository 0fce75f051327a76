"""Request path benchmark: a witnessed `route` over HTTP against a bare aiohttp handler.

Both servers run in this process, on its event loop, bound to 127.0.0.1, TCP with the bearer
token (the daemon's full guard: Host, Origin, token, body limit). The load comes from another
process: `wrk` (1 thread, 16 keep-alive connections) when it is installed (`make install`
installs it as root), otherwise a small aiohttp client started with this interpreter. Rounds
alternate bare / route, each ROUND_S long; the table gives the median of the per-round ratios.

Every `route` is witnessed: one ledger append (fsynced, group commit) per request.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from surfaces.http import HttpOptions, create_app
from tests.bench.bench_surfaces import a_daemon, hello_app, served
from tests.bench.table import print_rows

TOKEN = "bench-token"
CONNECTIONS = 16
ROUND_S = 3.0
ROUNDS = 5
BODY = {"text": "the api server returns 500 on login"}
ROOT = Path(__file__).resolve().parents[2]


async def wrk(url: str, script: Path) -> float:
    """Requests/s wrk measured; a non-2xx answer fails the bench."""
    proc = await asyncio.create_subprocess_exec(
        "wrk",
        "-t1",
        f"-c{CONNECTIONS}",
        f"-d{ROUND_S:g}s",
        "--timeout",
        "5s",
        "-s",
        str(script),
        url,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), ROUND_S + 30)
    text = out.decode()
    if proc.returncode != 0 or "Non-2xx" in text or "Socket errors" in text:
        raise RuntimeError(f"wrk against {url} failed:\n{text}")
    found = re.search(r"Requests/sec:\s+([0-9.]+)", text)
    assert found is not None, text
    return float(found.group(1))


async def python_client(url: str) -> float:
    """The fallback load generator, in a child process (see `load`)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.bench.bench_request",
        "load",
        url,
        cwd=str(ROOT),
        stdout=asyncio.subprocess.PIPE,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), ROUND_S + 30)
    if proc.returncode != 0:
        raise RuntimeError(f"the load generator failed against {url}")
    return float(out.decode().strip())


async def load(url: str) -> float:
    """CONNECTIONS keep-alive clients posting BODY for ROUND_S: requests/s (run as a child)."""
    stop = time.perf_counter() + ROUND_S
    count = 0
    connector = aiohttp.TCPConnector(limit=CONNECTIONS)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with aiohttp.ClientSession(connector=connector, headers=headers) as session:

        async def client() -> None:
            nonlocal count
            while time.perf_counter() < stop:
                async with session.post(url, json=BODY) as resp:
                    await resp.read()
                    if resp.status != 200:
                        raise RuntimeError(f"{url} answered {resp.status}")
                count += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(CONNECTIONS)))
        return count / (time.perf_counter() - t0)


async def measure(rows: list[tuple[str, str]]) -> None:
    use_wrk = shutil.which("wrk") is not None
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "post.lua"
        script.write_text(
            'wrk.method = "POST"\n'
            f"wrk.body = {json.dumps(json.dumps(BODY))}\n"
            'wrk.headers["Content-Type"] = "application/json"\n'
            f'wrk.headers["Authorization"] = "Bearer {TOKEN}"\n'
        )

        async def hit(url: str) -> float:
            return await (wrk(url, script) if use_wrk else python_client(url))

        async with a_daemon(Path(tmp)) as (daemon, _):
            app = create_app(daemon, HttpOptions(token=TOKEN))
            routes, bares, ratios = [], [], []
            async with served(app) as base, served(hello_app()) as hello:
                await hit(f"{hello}/hello")  # warm-up, not counted
                await hit(f"{base}/v1/tools/route")
                for i in range(ROUNDS):
                    order = [True, False] if i % 2 else [False, True]
                    got: dict[bool, float] = {}
                    for is_route in order:
                        url = f"{base}/v1/tools/route" if is_route else f"{hello}/hello"
                        got[is_route] = await hit(url)
                    routes.append(got[True])
                    bares.append(got[False])
                    ratios.append(got[True] / got[False])
            entries = daemon.ledger.size
    tool = "wrk -t1" if use_wrk else "an aiohttp client process"
    rows.append(("load generator", f"{tool}, {CONNECTIONS} connections, {ROUND_S:g} s rounds"))
    rows.append(("witnessed route over HTTP, req/s (median)", f"{statistics.median(routes):,.0f}"))
    rows.append(("bare aiohttp handler, req/s (median)", f"{statistics.median(bares):,.0f}"))
    rows.append(
        (
            f"route / bare, median of {ROUNDS} per-round ratios (target >= 0.45)",
            f"{statistics.median(ratios):.2f} (rounds: {', '.join(f'{r:.2f}' for r in ratios)})",
        )
    )
    rows.append(("ledger entries written by the route rounds", f"{entries:,}"))


def main() -> None:
    rows: list[tuple[str, str]] = []
    asyncio.run(measure(rows))
    print_rows(rows)


if __name__ == "__main__":
    if sys.argv[1:2] == ["load"]:
        print(asyncio.run(load(sys.argv[2])))
    else:
        main()
