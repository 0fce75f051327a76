"""The console's run page shows an agent task's steps, in a real headless browser (Debian's
chromium driven by Playwright): a tick per step on the attempt's timeline bar and a list under
the attempt (tool, arguments, outcome, seq; the observation below). What the model wrote is
hostile: markup in a file it writes is shown as text and never becomes an element.

The daemon is real, its model the scripted tool-calling fake, its workspace a real git project
run through real bubblewrap."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from daemon.service import Daemon
from tests.agent.model import ToolServer
from tests.agent.test_executor import HOSTILE, LANES, SCRIPT, agent_plan
from tests.console.conftest import Served, serve_both
from tests.runs.model_server import roster_toml, settings_for
from tests.workspace.repo import project

CHROMIUM = shutil.which("chromium")
pytestmark = [
    pytest.mark.skipif(CHROMIUM is None, reason="Debian chromium is not installed (make install)"),
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap"),
]
playwright_api = pytest.importorskip("playwright.async_api")


@pytest.fixture
async def served(tmp_path: Path) -> AsyncIterator[tuple[Served, Path]]:
    server = ToolServer(SCRIPT)  # its 7th step writes a file of markup (HOSTILE)
    await server.start()
    src = project(tmp_path / "src")
    daemon = Daemon(
        settings_for(tmp_path, roster_toml(server.url, lanes=LANES), workspace_roots=(src.parent,))
    )
    await daemon.start()
    try:
        async for s in serve_both(daemon, tmp_path):
            yield s, src
    finally:
        await daemon.stop()
        await server.stop()


async def test_the_run_page_shows_each_agent_step_as_text(
    served: tuple[Served, Path], tmp_path: Path
) -> None:
    real, src = served
    view = await real.daemon.engine.submit("Fix add", plan=agent_plan(), workspace=str(src))
    done = await real.daemon.engine.wait(view.id, timeout=120)
    assert done.state == "done", done.error
    errors: list[str] = []
    async with playwright_api.async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            page = await browser.new_page(viewport={"width": 1400, "height": 900})
            page.set_default_timeout(30_000)
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            await page.goto(await real.login_url())
            await page.wait_for_url(f"{real.url}/")
            await page.goto(f"{real.url}/#/run/{view.id}")
            await page.wait_for_selector("#run-state.state-done")
            steps = page.locator('section.task[data-task="t1"] ol.steps > li')
            assert await steps.count() == 8
            first = await steps.nth(1).locator("summary").inner_text()
            assert "step 2" in first
            assert "read_file(path=calc.py)" in first
            assert "→ ok" in first
            refused = steps.nth(3)
            assert "step-finish_refused" in (await refused.get_attribute("class") or "")
            await refused.locator("summary").click()
            assert "finish refused" in await refused.locator("pre.observation").inner_text()
            # the markup the model wrote is text in the page, never an element
            written = steps.nth(6)
            await written.locator("summary").click()
            assert HOSTILE[:28] in await written.locator("summary").inner_text()
            assert await page.locator("#tasks img").count() == 0
            ticks = page.locator('#timeline .tl-row[data-task="t1"] .bar.step')
            assert await ticks.count() == 8
            await page.screenshot(path=tmp_path / "agent-run.png", full_page=True)
        finally:
            await browser.close()
    assert errors == []
