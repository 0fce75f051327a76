"""The console in a real headless browser (Debian's chromium driven by Playwright, never a
downloaded browser) against a daemon whose pool is the real embedded SmolLM2 model.

Logs in through a one-time URL (the session's header secret then reads every page and
stream); watches a submitted plan's run appear and finish live; checks
the DAG has the plan's node count; opens a task's output; verifies an entry in the browser (pass)
and again with its proof tampered in transit (fail); opens the pool and ledger pages; saves a
screenshot of each page; any console error in the browser fails the test."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from daemon.config import Settings
from daemon.runs import entries as k
from daemon.service import Daemon
from tests.console.conftest import Served, serve_both

CHROMIUM = shutil.which("chromium")
pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(CHROMIUM is None, reason="Debian chromium is not installed (make install)"),
]
playwright_api = pytest.importorskip("playwright.async_api")

PLAN = {
    "tasks": [
        {"id": "outline", "lane": "docs", "instruction": "List two sections for a README."},
        {
            "id": "intro",
            "lane": "writing",
            "instruction": "Write one sentence introducing the project.",
            "needs": ["outline"],
        },
    ]
}


@pytest.fixture
async def real(tmp_path: Path) -> AsyncIterator[Served]:
    settings = Settings.from_env(
        state_dir=tmp_path / "state", runtime_dir=tmp_path / "run", checkpoint_interval_s=3600
    )
    daemon = Daemon(settings)
    await daemon.start()
    try:
        async for served in serve_both(daemon, tmp_path):
            yield served
    finally:
        await daemon.stop()


async def test_the_console_in_a_browser(real: Served, tmp_path: Path) -> None:
    errors: list[str] = []
    shots = tmp_path / "screenshots"
    shots.mkdir()
    async with playwright_api.async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            page = await browser.new_page(viewport={"width": 1400, "height": 900})
            page.set_default_timeout(30_000)
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda exc: errors.append(str(exc)))

            await page.goto(await real.login_url())  # its script POSTs the code, then "/"
            await page.wait_for_url(f"{real.url}/")
            await page.wait_for_selector("#runs")
            view = await real.daemon.engine.submit("a README for tally", plan=PLAN)
            deltas: list[dict[str, Any]] = []

            async def collect() -> None:
                async for event in real.daemon.engine.events(view.id):
                    if event.kind == "delta" and event.data is not None:
                        deltas.append(event.data)

            collector = asyncio.create_task(collect())
            row = page.locator(f'tr[data-run="{view.id}"]')
            await row.wait_for()  # appeared live, over the run feed
            await page.locator(f'tr[data-run="{view.id}"].state-done').wait_for(timeout=600_000)
            await page.screenshot(path=shots / "runs.png", full_page=True)

            await asyncio.wait_for(collector, 60)
            # the spawned server streams: each task's tokens reach the run's stream live
            assert {d.get("task") for d in deltas} >= {"outline", "intro", None}
            await row.locator("a").click()
            await page.wait_for_selector("#run-state.state-done")
            assert await page.locator("#dag .node").count() == len(PLAN["tasks"])
            assert await page.locator("#dag .node.state-done").count() == len(PLAN["tasks"])
            output = page.locator('section.task[data-task="outline"] details.output').first
            await output.locator("summary").click()
            text = await output.locator("pre").inner_text()
            done = await real.daemon.engine.wait(view.id)
            outline = done.task("outline")
            assert outline is not None
            assert text.strip() == (outline.result or "").strip()
            assert text.strip()
            assert await page.locator("#answer-text").inner_text()
            await page.screenshot(path=shots / "run.png", full_page=True)

            await real.daemon.ledger.checkpoint()  # covers the run's entries
            answer = await real.daemon.ledger.entries(run=view.id, kind=k.ANSWER, limit=1)
            seq = answer[0].seq
            await page.goto(f"{real.url}/#/ledger/{seq}")
            await page.locator("#pin").click()  # first use: pin the daemon's key
            await page.wait_for_selector("#unpin")
            await page.locator("#verify-here").click()
            result = page.locator("#verify-result")
            await result.wait_for()
            assert (await result.inner_text()).startswith("pass"), await page.locator(
                "#verify-steps"
            ).inner_text()
            assert await page.locator("#verify-steps li.ok").count() == 5
            await page.screenshot(path=shots / "verify-pass.png", full_page=True)

            async def tamper(route: Any) -> None:
                response = await route.fetch()
                body = await response.json()
                first = body["path"][0]
                body["path"][0] = ("0" if first[0] != "0" else "1") + first[1:]
                await route.fulfill(response=response, body=json.dumps(body))

            await page.route("**/v1/tools/ledger_proof", tamper)
            await page.locator("#verify-here").click()
            await page.locator("#verify-result.bad").wait_for()
            assert (await result.inner_text()).startswith("fail")
            assert await page.locator("#verify-steps li.bad").count() == 1
            await page.screenshot(path=shots / "verify-fail.png", full_page=True)
            await page.unroute("**/v1/tools/ledger_proof")

            await page.goto(f"{real.url}/#/ledger")
            await page.wait_for_selector("#entries tbody tr")
            assert "verified" in await page.locator("#verify-status").inner_text()
            await page.screenshot(path=shots / "ledger.png", full_page=True)

            ttft = real.daemon.timings.ttft_seconds  # llama.cpp reports its prompt time
            assert sum(n for counts in ttft.counts.values() for n in counts) >= 3
            rates = real.daemon.timings.tokens_per_second
            assert sum(n for counts in rates.counts.values() for n in counts) >= 3

            await page.goto(f"{real.url}/#/pool")
            await page.wait_for_selector("#members tbody tr")
            await page.screenshot(path=shots / "pool.png", full_page=True)

            # (two real runs would double the test's time: the CLI test compares two runs)
            await page.goto(f"{real.url}/#/compare/{view.id}/{view.id}")
            await page.wait_for_selector("#compare")
            assert await page.locator("#compare tbody tr").count() == 11
            await page.screenshot(path=shots / "compare.png", full_page=True)
        finally:
            await browser.close()
    assert not errors, errors
    names = {p.name for p in shots.iterdir()}
    assert names >= {"runs.png", "run.png", "ledger.png", "pool.png", "compare.png"}
