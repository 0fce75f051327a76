"""Who reaches the console: one-time login codes, the session secret, scopes and origins, on a
real TCP socket with the real HTTP app; `tally console` runs as a real process."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from yarl import URL

from surfaces import console
from surfaces.http import HttpOptions, create_app
from tests.console.conftest import ROOT, Served
from tests.slots.fake_server import FakeServer
from tests.surfaces.conftest import two_tasks


def _headers(secret: str, origin: str | None) -> dict[str, str]:
    headers = {console.HEADER: secret}
    if origin is not None:
        headers["Origin"] = origin
    return headers


async def _post(
    served: Served, tool: str, body: dict[str, Any], secret: str, origin: str | None = "same"
) -> tuple[int, dict[str, Any]]:
    origin = served.url if origin == "same" else origin
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            f"{served.url}/v1/tools/{tool}", json=body, headers=_headers(secret, origin)
        ) as resp,
    ):
        return resp.status, await resp.json()


async def test_without_a_session_apis_answer_401_and_pages_hold_no_data(served: Served) -> None:
    async with aiohttp.ClientSession() as http:
        for path in ("/v1/events", "/v1/tools", "/metrics", "/v1/console/session"):
            async with http.get(served.url + path) as resp:
                assert resp.status == 401, path
        async with http.post(f"{served.url}/v1/tools/runs_list", json={}) as resp:
            assert resp.status == 401
        forged = {console.HEADER: "forged-session-secret-0123456789"}
        async with http.post(f"{served.url}/v1/tools/runs_list", json={}, headers=forged) as r:
            assert r.status == 401
        async with http.post(served.url + console.LOGOUT_PATH, json={}) as resp:
            assert resp.status == 401  # logging out needs the session's own secret
        # the pages are the package's static files: served to anyone, nothing in them
        for path in ("/", "/console/app.js", "/console/login"):
            async with http.get(served.url + path) as resp:
                assert resp.status == 200, path
                assert "script-src 'self'" in resp.headers["Content-Security-Policy"]
        for name in ("..%2f__init__.py", "%2e%2e%2f__init__.py", "__init__.py"):
            async with http.get(URL(f"{served.url}/console/{name}", encoded=True)) as resp:
                assert resp.status == 404, name


async def test_a_code_works_once_by_post_from_the_console_and_sets_no_cookie(
    served: Served,
) -> None:
    url = await served.login_url()
    assert url.startswith(f"{served.url}/console/login#code=")  # a fragment: never sent
    code = url.split("#code=", 1)[1]
    login = served.url + console.LOGIN_PATH
    async with aiohttp.ClientSession() as http:
        # the old state-changing GET is gone: a GET with the code changes nothing
        async with http.get(f"{login}?code={code}", allow_redirects=False) as resp:
            assert resp.status == 200
            assert "Set-Cookie" not in resp.headers
        # a POST from another page (another local port, or no Origin at all) is refused
        port = int(served.url.rsplit(":", 1)[1])
        for origin in (None, f"http://127.0.0.1:{port + 1}", "http://localhost:1"):
            headers = {"Origin": origin} if origin else {}
            async with http.post(login, json={"code": code}, headers=headers) as resp:
                assert resp.status == 403, origin
        same = {"Origin": served.url}
        crossed = {**same, "Sec-Fetch-Site": "same-site"}  # a page on another port's fetch
        async with http.post(login, json={"code": code}, headers=crossed) as resp:
            assert resp.status == 403
        async with http.post(login, json={"code": code}, headers=same) as resp:
            assert resp.status == 200
            assert "Set-Cookie" not in resp.headers
            assert resp.headers["Cache-Control"] == "no-store"
            answer = await resp.json()
        assert answer["client"] == "console"
        assert answer["scope"] == "read"
        async with http.post(login, json={"code": code}, headers=same) as resp:
            assert resp.status == 401  # spent
        async with http.post(login, json={"code": "made-up"}, headers=same) as resp:
            assert resp.status == 401
        secret = answer["session"]
        async with http.get(
            served.url + "/v1/console/session", headers=_headers(secret, None)
        ) as resp:
            assert resp.status == 200
            who = await resp.json()
        assert (who["client"], who["scope"]) == ("console", "read")
        assert 0 < who["expires_in_s"] <= console.SESSION_TTL_S
        async with http.post(
            served.url + console.LOGOUT_PATH, json={}, headers=_headers(secret, served.url)
        ) as resp:
            assert resp.status == 200
        status, _ = await _post(served, "runs_list", {}, secret)
        assert status == 401  # ended


async def test_login_by_cross_site_navigation_is_refused(served: Served) -> None:
    url = await served.login_url()
    async with aiohttp.ClientSession() as http:
        for site in ("cross-site", "same-site"):  # another site; another port of this host
            headers = {"Sec-Fetch-Site": site, "Sec-Fetch-Mode": "navigate"}
            async with http.get(url, headers=headers) as resp:
                assert resp.status == 403, site
                assert "opened directly" in await resp.text()
        async with http.get(url, headers={"Sec-Fetch-Site": "none"}) as resp:
            assert resp.status == 200  # typed, pasted, or opened by `tally console --open`


async def test_the_cookie_or_secret_replayed_from_another_port_is_refused(served: Served) -> None:
    """What another loopback web server receives from the browser (every cookie for the
    host, and the Origin it can claim) gets nothing: sessions live in a header only the
    console's script sends; a secret replayed with another page's Origin is refused too."""
    admin = await served.session("--admin")
    port = int(served.url.rsplit(":", 1)[1])
    replay = {"Cookie": f"tally_session={admin}", "Origin": served.url}
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{served.url}/v1/tools/client_list", json={}, headers=replay) as resp,
    ):
        assert resp.status == 401
    for origin in ("http://evil.example", f"http://127.0.0.1:{port + 1}", "null"):
        status, body = await _post(served, "client_list", {}, admin, origin)
        assert status == 403, origin
        assert body["error"]["code"] == "forbidden_origin"
    status, _ = await _post(served, "client_list", {}, admin)
    assert status == 200


async def test_a_read_session_reads_but_cannot_cancel(served: Served, model: FakeServer) -> None:
    model.token_delay_s = 0.05  # the run stays in flight while we try to cancel it
    view = await served.daemon.engine.submit("the api", plan=two_tasks())
    read = await served.session()
    status, body = await _post(served, "runs_list", {}, read)
    assert status == 200
    assert [r["id"] for r in body["runs"]] == [view.id]
    status, body = await _post(served, "run_cancel", {"run_id": view.id}, read)
    assert status == 403
    assert body["error"]["details"] == {"needed": "submit", "client": "console"}
    admin = await served.session("--admin")
    status, body = await _post(served, "run_cancel", {"run_id": view.id}, admin)
    assert status == 200
    assert body["state"] in ("cancelled", "done")


async def test_only_an_admin_mints_codes(served: Served) -> None:
    admin = await served.session("--admin")
    read = await served.session()
    async with aiohttp.ClientSession() as http:
        for secret, status in ((read, 403), (admin, 200)):
            async with http.post(
                served.url + "/v1/console/code", json={}, headers=_headers(secret, served.url)
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
    secret = await served.session("--client", "alice")
    status, _ = await _post(served, "runs_list", {}, secret)
    assert status == 200
    served.daemon.clients.revoke("alice")
    status, _ = await _post(served, "runs_list", {}, secret)
    assert status == 401


async def test_the_run_feed_streams_run_changes(served: Served) -> None:
    secret = await served.session()
    seen: list[dict[str, Any]] = []
    async with (
        aiohttp.ClientSession() as http,
        http.get(served.url + "/v1/events", headers=_headers(secret, None)) as resp,
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
    read, admin = await served.session(), await served.session("--admin")
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
