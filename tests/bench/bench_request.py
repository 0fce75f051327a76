"""Request path benchmark: a witnessed `route` over HTTP against a bare aiohttp handler, and
against forum-engine 1.17's own daemon answering the same request.

Both tally servers run in this process, on its event loop, bound to 127.0.0.1, TCP with the
bearer token (the daemon's full guard: Host, Origin, token, body limit). The load comes from
another process: `wrk` (1 thread, 16 keep-alive connections) when it is installed (`make
install` installs it as root), otherwise a small aiohttp client started with this interpreter.
Rounds take the targets in turn (the order rotates), each ROUND_S long; the table gives the
median of the per-round ratios.

Every `route` is witnessed: one ledger append (fsynced, group commit) per request.

forum-engine (the `bench` extra; a "not installed" row without it) is `forum serve --no-auth`
in a child process on 127.0.0.1, its ledger in the temp dir, answering `POST /route` with
body {"text": ...}: the same text, the same load, in the same rounds. It differs in two ways
the rows say: its hand-written HTTP/1.1 server answers every request with `Connection: close`,
so wrk's keep-alive connections reconnect per request (that is how forum serves, measured as
it is); and without auth its `/route` scores the text and appends nothing to its ledger (the
row gives the count it reports), where tally's route is witnessed.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
import shutil
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def wait_healthy(base: str, proc: asyncio.subprocess.Process, log: Path) -> None:
    """Poll forum's /health until it answers (it prints its banner only when stdout flushes)."""
    deadline = time.monotonic() + 15
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if proc.returncode is not None:
                said = await asyncio.to_thread(log.read_text)
                raise RuntimeError(f"forum serve exited {proc.returncode}:\n{said}")
            try:
                async with session.get(f"{base}/health") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientConnectionError:
                pass
            await asyncio.sleep(0.1)
    said = await asyncio.to_thread(log.read_text)
    raise RuntimeError(f"forum serve did not answer /health within 15 s:\n{said}")


@asynccontextmanager
async def forum_daemon(tmp: Path) -> AsyncIterator[str | None]:
    """forum-engine's daemon on 127.0.0.1 in a child process, its ledger under `tmp`; None
    when the `bench` extra is not installed."""
    if importlib.util.find_spec("forum") is None:
        yield None
        return
    port = free_port()
    log = tmp / "forum.log"
    with log.open("wb") as out:
        # `python -m forum` is the `forum` console script with this interpreter: no PATH lookup.
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "forum",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--no-auth",
            "--ledger",
            str(tmp / "forum-ledger"),
            stdout=out,
            stderr=asyncio.subprocess.STDOUT,
        )
    try:
        base = f"http://127.0.0.1:{port}"
        await wait_healthy(base, proc, log)
        yield base
    finally:
        if proc.returncode is None:
            proc.terminate()  # SIGTERM: forum drains and stops
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()


async def forum_entries(base: str) -> int:
    async with aiohttp.ClientSession() as session, session.get(f"{base}/status") as resp:
        resp.raise_for_status()
        entries: int = (await resp.json())["entries"]
        return entries


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

        async with a_daemon(Path(tmp)) as (daemon, _), forum_daemon(Path(tmp)) as forum:
            app = create_app(daemon, HttpOptions(token=TOKEN))
            got: dict[str, list[float]] = {"route": [], "bare": [], "forum": []}
            ratios: list[float] = []
            vs_forum: list[float] = []
            async with served(app) as base, served(hello_app()) as hello:
                urls = {"bare": f"{hello}/hello", "route": f"{base}/v1/tools/route"}
                if forum is not None:
                    urls["forum"] = f"{forum}/route"
                for url in urls.values():  # warm-up, not counted
                    await hit(url)
                names = list(urls)
                for i in range(ROUNDS):
                    # Rotate the order so no target always runs first (or after the same one).
                    for name in names[i % len(names) :] + names[: i % len(names)]:
                        got[name].append(await hit(urls[name]))
                    ratios.append(got["route"][-1] / got["bare"][-1])
                    if forum is not None:
                        vs_forum.append(got["route"][-1] / got["forum"][-1])
            entries = daemon.ledger.size
            forum_written = await forum_entries(forum) if forum is not None else 0
    tool = "wrk -t1" if use_wrk else "an aiohttp client process"
    rows.append(("load generator", f"{tool}, {CONNECTIONS} connections, {ROUND_S:g} s rounds"))
    rows.append(
        ("witnessed route over HTTP, req/s (median)", f"{statistics.median(got['route']):,.0f}")
    )
    rows.append(("bare aiohttp handler, req/s (median)", f"{statistics.median(got['bare']):,.0f}"))
    rows.append(
        (
            f"route / bare, median of {ROUNDS} per-round ratios (target >= 0.45)",
            f"{statistics.median(ratios):.2f} (rounds: {', '.join(f'{r:.2f}' for r in ratios)})",
        )
    )
    rows.append(("ledger entries written by the route rounds", f"{entries:,}"))
    if forum is None:
        rows.append(("forum-engine route over HTTP", "not installed (pip install -e '.[bench]')"))
        return
    rows.append(
        (
            "forum-engine 1.17 route over HTTP, req/s (median)",
            f"{statistics.median(got['forum']):,.0f} (its server sends Connection: close, so "
            f"every request reconnects; unwitnessed: {forum_written:,} ledger entries written)",
        )
    )
    rows.append(
        (
            f"witnessed route / forum-engine route, median of {ROUNDS} per-round ratios",
            f"tally = {statistics.median(vs_forum):.2f} × forum "
            f"(rounds: {', '.join(f'{r:.2f}' for r in vs_forum)})",
        )
    )


def main() -> None:
    rows: list[tuple[str, str]] = []
    asyncio.run(measure(rows))
    print_rows(rows)


if __name__ == "__main__":
    if sys.argv[1:2] == ["load"]:
        print(asyncio.run(load(sys.argv[2])))
    else:
        main()
