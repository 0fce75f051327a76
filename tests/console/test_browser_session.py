"""Console sessions in a real headless browser (Debian's chromium driven by Playwright), against
the real HTTP app and daemon with the fake model server as the pool's stand-in.

A login through the one-time URL leaves no cookie, so a web server on another loopback port
receives nothing it could replay; a login reached from that server's page is refused; the pages
offer Cancel, Resume and Redact only where the session's scope and the run's state allow them."""

from __future__ import annotations

import shutil
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from daemon.slots.process import free_port
from tests.console.conftest import Served
from tests.slots.fake_server import FakeServer
from tests.surfaces.conftest import two_tasks

CHROMIUM = shutil.which("chromium")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="Debian chromium is not installed (make install)"
)
playwright_api = pytest.importorskip("playwright.async_api")


class Neighbour:
    """Another web server on loopback: it records what browsers send it, as an attacker would."""

    def __init__(self) -> None:
        self.cookies: list[str] = []
        self.url = ""
        self.target = ""  # where its page's link goes

    async def page(self, request: web.Request) -> web.Response:
        self.cookies.append(request.headers.get("Cookie", ""))
        html = f'<!doctype html><a id="go" href="{self.target}">console</a>'
        return web.Response(text=html, content_type="text/html")


@pytest.fixture
async def neighbour() -> AsyncIterator[Neighbour]:
    n = Neighbour()
    app = web.Application()
    app.router.add_get("/", n.page)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    n.url = f"http://127.0.0.1:{port}/"
    try:
        yield n
    finally:
        await runner.cleanup()


async def _login(browser: Any, served: Served, *flags: str) -> Any:
    context = await browser.new_context()
    page = await context.new_page()
    page.set_default_timeout(20_000)
    await page.goto(await served.login_url(*flags))
    await page.wait_for_url(f"{served.url}/")
    await page.wait_for_selector("#runs")  # the runs page read runs_list: an API call
    return page


async def _buttons(page: Any, url: str) -> set[str]:
    await page.goto(url)
    await page.wait_for_selector("#run-state, #verify-here")
    found = set()
    for name in ("cancel", "resume", "redact"):
        if await page.locator(f"#{name}").count():
            found.add(name)
    return found


async def test_sessions_in_a_browser(
    served: Served, model: FakeServer, neighbour: Neighbour
) -> None:
    engine = served.daemon.engine
    finished = await engine.submit("the api", plan=two_tasks())
    await engine.wait(finished.id, timeout=30)
    request = (await served.daemon.ledger.entries(run=finished.id, limit=1))[0]
    model.token_delay_s = 0.2  # this one stays in flight while the pages look at it
    running = await engine.submit("the api", plan=two_tasks())
    errors: list[str] = []
    async with playwright_api.async_playwright() as pw:
        browser = await pw.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            admin = await _login(browser, served, "--admin")
            admin.on("pageerror", lambda exc: errors.append(str(exc)))
            assert await admin.context.cookies() == []
            assert "console-admin (admin)" in await admin.locator("#who").inner_text()
            live = await engine.submit("the feed", plan=two_tasks())  # SSE read with fetch
            await admin.locator(f'tr[data-run="{live.id}"]').wait_for()
            await engine.cancel(live.id)
            await admin.locator(f'tr[data-run="{live.id}"].state-cancelled').wait_for()
            assert await _buttons(admin, f"{served.url}/#/run/{running.id}") == {"cancel"}
            assert await _buttons(admin, f"{served.url}/#/run/{finished.id}") == set()
            assert await _buttons(admin, f"{served.url}/#/ledger/{request.seq}") == {"redact"}

            # another local server gets every cookie the browser holds for this host
            await admin.goto(neighbour.url)
            replay = {"Cookie": neighbour.cookies[-1], "Origin": served.url}
            async with (
                aiohttp.ClientSession() as http,
                http.post(f"{served.url}/v1/tools/client_list", json={}, headers=replay) as r,
            ):
                assert r.status == 401

            read = await _login(browser, served)
            read.on("pageerror", lambda exc: errors.append(str(exc)))
            assert "console (read)" in await read.locator("#who").inner_text()
            assert await _buttons(read, f"{served.url}/#/run/{running.id}") == set()
            assert await _buttons(read, f"{served.url}/#/ledger/{request.seq}") == set()

            # a login URL reached from that server's page: refused before the page can run
            neighbour.target = await served.login_url()
            await read.goto(neighbour.url)
            await read.locator("#go").click()
            await read.wait_for_url(f"{served.url}/console/login*")
            assert "opened directly" in await read.locator("body").inner_text()
        finally:
            await browser.close()
            model.token_delay_s = 0
            await engine.cancel(running.id)
    assert not errors, errors
