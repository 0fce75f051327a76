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


# Runs made before the browser's daemon starts (no model call): one that fails after a task
# did its work, and one whose attempt a daemon stop cut off, resumed, then cancelled.
FAILING = {
    "tasks": [
        {"id": "made", "lane": "backend", "instruction": "x", "executor": "command",
         "argv": ["echo", "partial work done"]},
        {"id": "broke", "lane": "backend", "instruction": "x", "executor": "command",
         "argv": ["false"], "needs": ["made"], "assertions": [{"type": "exit_code", "code": 0}]},
    ]
}  # fmt: skip
SLEEPING = {
    "tasks": [
        {"id": "nap", "lane": "backend", "instruction": "x", "executor": "command",
         "argv": ["sleep", "60"]},
    ]
}  # fmt: skip


def _settings(tmp_path: Path) -> Settings:
    return Settings.from_env(
        state_dir=tmp_path / "state",
        runtime_dir=tmp_path / "run",
        checkpoint_interval_s=3600,
        drain_s=0.1,
    )


async def _started(daemon: Daemon, run_id: str, attempts: int) -> None:
    for _ in range(300):
        view = daemon.engine.get(run_id)
        if view.tasks and view.tasks[0].attempts >= attempts and view.tasks[0].state == "running":
            await asyncio.sleep(0.3)  # the command is running, not only witnessed as started
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"run {run_id} did not start attempt {attempts}")


@pytest.fixture
async def history(tmp_path: Path) -> dict[str, str]:
    from daemon.tools.roster import RouteIn, route
    from daemon.tools.tool import ToolContext

    first = Daemon(_settings(tmp_path))
    await first.start()
    try:
        failed = await first.engine.submit(
            "console: a run that fails", plan=FAILING, lane="backend"
        )
        assert (await first.engine.wait(failed.id, timeout=60)).state == "failed"
        cut = await first.engine.submit("console: a run cut off", plan=SLEEPING, lane="backend")
        await _started(first, cut.id, 1)
        # Enough entries for the ledger page to have a second page (route previews are witnessed).
        await asyncio.gather(
            *(route(first, RouteIn(text=f"preview {i}"), ToolContext()) for i in range(120))
        )
    finally:
        await first.stop()  # the attempt is cut: the run is interrupted
    second = Daemon(_settings(tmp_path))
    await second.start()
    try:
        assert second.engine.get(cut.id).state == "interrupted"
        await second.engine.resume(cut.id)
        await _started(second, cut.id, 2)
        await second.engine.cancel(cut.id)
        assert (await second.engine.wait(cut.id, timeout=30)).state == "cancelled"
    finally:
        await second.stop()
    return {"failed": failed.id, "cut": cut.id}


@pytest.fixture
async def real(tmp_path: Path, history: dict[str, str]) -> AsyncIterator[Served]:
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


async def test_the_console_in_a_browser(
    real: Served, history: dict[str, str], tmp_path: Path
) -> None:
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
            # Before the real run (its model's speed is the machine's): the ledger page lists
            # newest first, a page of 100 at a time.
            await page.goto(f"{real.url}/#/ledger")
            await page.wait_for_selector("#entries tbody tr")
            first_page = await _seqs(page)
            assert len(first_page) == 100
            assert first_page == sorted(first_page, reverse=True)
            assert first_page[0] == real.daemon.ledger.size - 1
            await page.locator("#older").click()
            # (CSP forbids eval: wait for rows, not for a function)
            await page.locator(f'#entries tbody tr[data-seq="{first_page[-1] - 1}"]').wait_for()
            second_page = await _seqs(page)
            assert second_page == sorted(second_page, reverse=True)
            assert second_page[0] == first_page[-1] - 1
            await page.locator("#newer").click()
            await page.locator(f'#entries tbody tr[data-seq="{first_page[0]}"]').wait_for()

            # A run whose attempt a daemon stop cut off (resumed, then cancelled): each attempt
            # says how it ended, and the first one's time stops at the interruption.
            await page.goto(f"{real.url}/#/run/{history['cut']}")
            await page.wait_for_selector("#run-state.state-cancelled")
            nap = page.locator('section.task[data-task="nap"] .attempt')
            assert await nap.count() == 2
            assert "output (interrupted)" in await nap.nth(0).locator("summary").inner_text()
            assert "interrupted after" in await nap.nth(0).inner_text()
            assert "output (cancelled)" in await nap.nth(1).locator("summary").inner_text()
            assert "streaming" not in await page.locator("#tasks").inner_text()
            bars = page.locator('#timeline .tl-row[data-task="nap"] .bar.model.cut')
            assert await bars.count() == 2
            first_end = await bars.nth(0).evaluate(
                "b => parseFloat(b.style.left) + parseFloat(b.style.width)"
            )
            second_start = await bars.nth(1).evaluate("b => parseFloat(b.style.left)")
            assert first_end <= second_start < 100  # not spanning the whole run
            assert await page.locator("#timeline .tl-axis .tick").count() >= 2
            await page.screenshot(path=shots / "run-cut.png", full_page=True)

            # A failed run shows why, and the work it did, not "no answer yet".
            await page.goto(f"{real.url}/#/run/{history['failed']}")
            await page.wait_for_selector("#run-state.state-failed")
            assert (await page.locator("#answer-missing").inner_text()).startswith(
                "no answer: the run failed"
            )
            assert "partial work done" in await page.locator("#answer-partial").inner_text()
            await page.screenshot(path=shots / "run-failed.png", full_page=True)
            await page.goto(f"{real.url}/")
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
            fits = page.locator("#body-schema")  # the body against GET /v1/record/schema
            assert await fits.inner_text() == "✓ body: fits the published schema of run.answer"
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


async def _seqs(page: Any) -> list[int]:
    rows = page.locator("#entries tbody tr")
    return [int(s) for s in await rows.evaluate_all("rs => rs.map(r => r.dataset.seq)")]
