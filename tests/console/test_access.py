"""Who reaches the console: one-time login codes, the session cookie, scopes and origins, on a
real TCP socket with the real HTTP app; `tally console` runs as a real process."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from surfaces import console
from surfaces.http import HttpOptions, create_app
from tests.console.conftest import ROOT, Served
from tests.slots.fake_server import FakeServer
from tests.surfaces.conftest import two_tasks


def _headers(cookie: str, origin: str | None) -> dict[str, str]:
    headers = {"Cookie": f"{console.COOKIE}={cookie}"}
    if origin is not None:
        headers["Origin"] = origin
    return headers


async def _post(
    served: Served, tool: str, body: dict[str, Any], cookie: str, origin: str | None = "same"
) -> tuple[int, dict[str, Any]]:
    origin = served.url if origin == "same" else origin
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            f"{served.url}/v1/tools/{tool}", json=body, headers=_headers(cookie, origin)
        ) as resp,
    ):
        return resp.status, await resp.json()


async def test_without_a_cookie_pages_and_apis_answer_401(served: Served) -> None:
    async with aiohttp.ClientSession() as http:
        for path in ("/", "/console/app.js", "/v1/events", "/v1/tools", "/metrics"):
            async with http.get(served.url + path) as resp:
                assert resp.status == 401, path
        async with http.post(f"{served.url}/v1/tools/runs_list", json={}) as resp:
            assert resp.status == 401
        bad = {"Cookie": f"{console.COOKIE}=forged-session-id"}
        async with http.get(served.url + "/", headers=bad) as resp:
            assert resp.status == 401


async def test_a_code_works_once_and_sets_a_strict_httponly_cookie(served: Served) -> None:
    url = await served.login_url()
    assert url.startswith(f"{served.url}/console/login?code=")
    async with aiohttp.ClientSession() as http:
        async with http.get(url, allow_redirects=False) as resp:
            assert resp.status == 303
            assert resp.headers["Location"] == "/"
            raw = resp.headers["Set-Cookie"]
            assert "HttpOnly" in raw
            assert "SameSite=Strict" in raw
            cookie = resp.cookies[console.COOKIE].value
        async with http.get(url, allow_redirects=False) as resp:
            assert resp.status == 401  # spent
            assert console.COOKIE not in resp.cookies
        async with http.get(served.url + "/console/login?code=made-up") as resp:
            assert resp.status == 401
        async with http.get(served.url + "/", headers=_headers(cookie, None)) as resp:
            assert resp.status == 200
            assert "tally console" in await resp.text()
            assert "script-src 'self'" in resp.headers["Content-Security-Policy"]
        async with http.get(
            served.url + "/console/../__init__.py", headers=_headers(cookie, None)
        ) as resp:
            assert resp.status == 404


async def test_a_read_session_reads_but_cannot_cancel(served: Served, model: FakeServer) -> None:
    model.token_delay_s = 0.05  # the run stays in flight while we try to cancel it
    view = await served.daemon.engine.submit("the api", plan=two_tasks())
    read = await served.cookie()
    status, body = await _post(served, "runs_list", {}, read)
    assert status == 200
    assert [r["id"] for r in body["runs"]] == [view.id]
    status, body = await _post(served, "run_cancel", {"run_id": view.id}, read)
    assert status == 403
    assert body["error"]["details"] == {"needed": "submit", "client": "console"}
    admin = await served.cookie("--admin")
    status, body = await _post(served, "run_cancel", {"run_id": view.id}, admin)
    assert status == 200
    assert body["state"] in ("cancelled", "done")


async def test_cross_origin_posts_are_refused(served: Served) -> None:
    admin = await served.cookie("--admin")
    port = int(served.url.rsplit(":", 1)[1])
    for origin in (None, "http://evil.example", f"http://127.0.0.1:{port + 1}", "null"):
        status, body = await _post(served, "runs_list", {}, admin, origin)
        assert status == 403, origin
        assert body["error"]["code"] == "forbidden_origin"
    # a GET carrying another origin's Origin (a fetch from another local page) is refused too
    headers = _headers(admin, f"http://localhost:{port + 1}")
    async with aiohttp.ClientSession() as http, http.get(served.url + "/", headers=headers) as r:
        assert r.status == 403


async def test_only_an_admin_mints_codes(served: Served) -> None:
    admin = await served.cookie("--admin")
    read = await served.cookie()
    async with aiohttp.ClientSession() as http:
        for cookie, status in ((read, 403), (admin, 200)):
            async with http.post(
                served.url + "/v1/console/code", json={}, headers=_headers(cookie, served.url)
            ) as resp:
                assert resp.status == status
        async with http.post(
            served.url + "/v1/console/code",
            json={"client": "no-such"},
            headers=_headers(admin, served.url),
        ) as resp:
            assert resp.status == 404


async def test_a_session_bound_to_a_named_client_ends_when_it_is_revoked(served: Served) -> None:
    served.daemon.clients.add("alice", "submit")
    cookie = await served.cookie("--client", "alice")
    status, _ = await _post(served, "runs_list", {}, cookie)
    assert status == 200
    served.daemon.clients.revoke("alice")
    status, _ = await _post(served, "runs_list", {}, cookie)
    assert status == 401


async def test_the_run_feed_streams_run_changes(served: Served) -> None:
    cookie = await served.cookie()
    seen: list[dict[str, Any]] = []
    async with (
        aiohttp.ClientSession() as http,
        http.get(served.url + "/v1/events", headers=_headers(cookie, None)) as resp,
    ):
        assert resp.status == 200
        assert resp.headers["Content-Type"] == "text/event-stream"
        view = None
        event = ""
        async with asyncio.timeout(20):
            async for raw in resp.content:
                line = raw.decode().rstrip("\n")
                if line.startswith("event: "):
                    event = line[7:]
                    if event == "ready" and view is None:
                        view = await served.daemon.engine.submit("the api", plan=two_tasks())
                elif line.startswith("data: ") and event == "run":
                    seen.append(json.loads(line[6:]))
                    if seen[-1]["state"] == "done":
                        break
    assert view is not None
    assert {s["id"] for s in seen} == {view.id}
    assert seen[-1]["tasks_total"] == seen[-1]["tasks_done"] == 2


async def test_redaction_needs_an_admin_session_and_a_reason(served: Served) -> None:
    view = await served.daemon.engine.submit("the api", plan=two_tasks())
    await served.daemon.engine.wait(view.id, timeout=30)
    request = (await served.daemon.ledger.entries(run=view.id, limit=1))[0]
    assert request.body is not None
    read, admin = await served.cookie(), await served.cookie("--admin")
    body = {"body_hash": request.body, "reason": "a secret in the prompt"}
    status, _ = await _post(served, "ledger_redact", body, read)
    assert status == 403
    status, answer = await _post(served, "ledger_redact", {"body_hash": request.body}, admin)
    assert status == 422  # no reason, no redaction
    status, answer = await _post(served, "ledger_redact", body, admin)
    assert status == 200
    assert answer["actor"] == "console-admin"
    assert (await served.daemon.ledger.body(request.body)).value is None


async def test_console_without_a_tcp_listener_says_how_to_get_one(
    served: Served, tmp_path: Path
) -> None:
    path = tmp_path / "only-unix.sock"
    runner = web.AppRunner(create_app(served.daemon, HttpOptions()))
    await runner.setup()
    await web.UnixSite(runner, str(path)).start()
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "surfaces", "console", "--socket", str(path),
            cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        await runner.cleanup()
    assert proc.returncode == 2
    assert out == b""
    assert b"tally serve --tcp" in err
    assert b"Traceback" not in err
