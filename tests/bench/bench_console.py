"""Console benchmark: what a browser waits for, and what open consoles cost the runs.

1. First paint of the runs page with 10,000 runs in the daemon: navigation to the list's rows
   drawn (and the browser's first contentful paint), in Debian's chromium (headless, Playwright
   with the system executable). Target ≤ 300 ms.
2. The run page of a 200-task DAG (done): navigation to all 200 nodes and the timeline drawn.
   Target ≤ 1 s.
3. SSE fan-out: wall time of waves of 8 concurrent runs with 20 open run feeds (`/v1/events`,
   what a console's runs page holds) against none, interleaved rounds: the ratio should be
   1 ± noise. The 20 readers run in this process, on the daemon's event loop: an upper bound.

The daemon is the real one (ledger, engine, pool, HTTP app over TCP); its pool member is the
fake model server of tests/slots. The 10,000 runs are appended to the ledger as request + final
state pairs before the daemon starts, which restores them from the record as it would anyway.
"""

from __future__ import annotations

import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from daemon.ledger import Ledger
from daemon.runs import entries as k
from daemon.service import Daemon
from tests.console.conftest import Served, serve_both
from tests.slots.fake_server import FakeServer
from tests.surfaces.conftest import daemon_settings, two_tasks

RUNS = 10_000
LOADS = 5
ROUNDS = 5
BATCHES = 6
CONSOLES = 20
CONCURRENT = 8


async def _seed(state: Path, n: int) -> None:
    ledger = await Ledger.open(state)
    try:
        for start in range(0, n, 500):

            async def one(i: int) -> None:
                run = f"bench{i:06d}"
                request = {"request": f"bench request {i}", "lane": "backend", "client": "bench"}
                first = await ledger.append(actor=k.ACTOR, kind=k.REQUEST, body=request, run=run)
                await ledger.append(
                    actor=k.ACTOR, kind=k.STATE, body={"state": "done"}, run=run, parent=first.seq
                )

            await asyncio.gather(*(one(i) for i in range(start, min(n, start + 500))))
    finally:
        await ledger.close()


def _plan(tasks: int, width: int) -> dict[str, Any]:
    out = []
    for i in range(tasks):
        needs = [f"t{i - width}"] if i >= width else []
        out.append({"id": f"t{i}", "lane": "backend", "instruction": f"part {i}", "needs": needs})
    return {"tasks": out}


async def _pages(served: Served, big_run: str) -> tuple[list[float], list[float], list[float]]:
    from playwright.async_api import async_playwright

    chromium = shutil.which("chromium")
    rows, fcp, run_page = [], [], []
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=chromium, headless=True)
        try:
            # bypass_csp: only so wait_for_function may evaluate its predicate in the page
            page = await browser.new_page(viewport={"width": 1400, "height": 900}, bypass_csp=True)
            await page.goto(await served.login_url())
            await page.wait_for_selector("#runs tbody tr")
            for _ in range(LOADS):
                await page.goto("about:blank")
                await page.goto(f"{served.url}/#/runs")
                await page.wait_for_selector("#runs tbody tr")
                rows.append(await page.evaluate("performance.now()"))
                paint = await page.evaluate(
                    "performance.getEntriesByName('first-contentful-paint')[0]?.startTime ?? -1"
                )
                fcp.append(paint)
            for _ in range(LOADS):
                await page.goto("about:blank")
                await page.goto(f"{served.url}/#/run/{big_run}")
                await page.wait_for_function(
                    "document.querySelectorAll('#dag .node').length === 200 "
                    "&& document.querySelectorAll('#timeline .tl-row').length === 200",
                    timeout=60_000,
                )
                run_page.append(await page.evaluate("performance.now()"))
        finally:
            await browser.close()
    return rows, fcp, run_page


async def _batch(served: Served) -> float:
    """Seconds for BATCHES waves of CONCURRENT runs (two tasks and a synthesis each)."""
    engine = served.daemon.engine
    started = time.perf_counter()
    for _ in range(BATCHES):
        views = [await engine.submit("the api", plan=two_tasks()) for _ in range(CONCURRENT)]
        for view in views:
            await engine.wait(view.id, timeout=120)
    return time.perf_counter() - started


async def _with_consoles(served: Served, secret: str) -> float:
    headers = {"X-Tally-Session": secret}
    async with aiohttp.ClientSession(headers=headers) as http:
        streams = [await http.get(f"{served.url}/v1/events") for _ in range(CONSOLES)]
        frames = [0] * CONSOLES

        async def read(i: int, resp: aiohttp.ClientResponse) -> None:
            async for _ in resp.content:
                frames[i] += 1

        readers = [asyncio.create_task(read(i, r)) for i, r in enumerate(streams)]
        try:
            await asyncio.sleep(0.2)
            return await _batch(served)
        finally:
            for task in readers:
                task.cancel()
            for resp in streams:
                resp.close()


async def _main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = FakeServer(slots=4, n_ctx=4096)
        await model.start()
        settings = daemon_settings(root, model.url)
        began = time.perf_counter()
        await _seed(settings.state_dir, RUNS)
        seeded = time.perf_counter() - began
        daemon = Daemon(settings)
        await daemon.start()
        assert daemon.engine.census.runs["done"] == RUNS  # restored from the record
        try:
            async for served in serve_both(daemon, root):
                big = await daemon.engine.submit(
                    "a big plan",
                    plan=_plan(200, 10),
                    budget={"model_calls": 1000, "tokens": 10_000_000, "wall_s": 600},
                )
                done = await daemon.engine.wait(big.id, timeout=300)
                assert done.state == "done", done.error
                lines = [f"seeded {RUNS} runs in {seeded:.1f} s; 200-task run {big.id}"]
                if shutil.which("chromium"):
                    rows, fcp, run_page = await _pages(served, big.id)
                    lines += [
                        f"runs page, rows drawn (ms, median of {LOADS}) | "
                        f"{statistics.median(rows):.0f} | ≤ 300",
                        f"runs page, first contentful paint (ms) | "
                        f"{statistics.median(fcp):.0f} | ≤ 300",
                        f"run page, 200-task DAG + timeline drawn (ms) | "
                        f"{statistics.median(run_page):.0f} | ≤ 1000",
                    ]
                else:
                    lines.append("page loads | skipped: no chromium (make install) |")
                secret = await served.session()
                plain, fanned = [], []
                for _ in range(ROUNDS):
                    plain.append(await _batch(served))
                    fanned.append(await _with_consoles(served, secret))
                ratio = statistics.median(fanned) / statistics.median(plain)
                lines += [
                    f"{BATCHES} × {CONCURRENT} runs, no console (s, median of {ROUNDS}) | "
                    f"{statistics.median(plain):.2f} |",
                    f"{BATCHES} × {CONCURRENT} runs, {CONSOLES} open run feeds (s) | "
                    f"{statistics.median(fanned):.2f} |",
                    f"run-overhead ratio with/without consoles | {ratio:.2f} | 1 ± noise",
                ]
                print("| measure | value | target |\n|---|---|---|")
                print(lines[0], file=sys.stderr)
                for line in lines[1:]:
                    print(f"| {line} |")
        finally:
            await daemon.stop()
            await model.stop()


def main() -> None:
    asyncio.run(_main())


if __name__ == "__main__":
    main()
