"""Remote verification never raises: a hostile `tally = true` member fails its own calls.

Two tally members serve the second daemon: `first`, the first daemon's gateway as it is, and
`evil`, the same gateway behind a proxy that, once the calls are made, answers the ledger tools
with something hostile — 100k-deep JSON, a 5 MiB body, wrong types, a forged proof, silence,
an answer that drips a byte at a time.
`ledger_verify_remote` over HTTP answers 200 every time: evil's call is `failed` with its
reason, and first's call is still proven `ok`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

import daemon.remotes
from daemon.service import Daemon
from surfaces.http import HttpOptions, create_app
from tests.runs.model_server import roster_toml, settings_for
from tests.slots.fake_server import FakeServer

TOKEN_ENV = "REMOTE_HOSTILE_TEST_TOKEN"


def _roster(good: str, evil: str, key: str) -> str:
    members = "".join(
        f'[[models]]\nname = "{name}"\nurl = "{url}"\nmodel_id = "tier:cheap"\ntally = true\n'
        f'tally_key = "{key}"\napi_key_env = "{TOKEN_ENV}"\nslots = 2\n\n'
        for name, url in (("first", good), ("evil", evil))
    )
    lanes = "".join(
        f'[[lanes]]\nname = "{lane}"\nkeywords = ["{lane}"]\ntier = "{tier}"\n'
        f'system = "You do {lane}."\n\n'
        for lane, tier in (("docs", "good"), ("backend", "bad"))
    )
    tiers = '[tiers]\nladder = ["good", "bad"]\ngood = ["first"]\nbad = ["evil"]\n\n'
    return f"version = 1\n{members}{tiers}{lanes}"


class Proxy:
    """Forwards to the first daemon; once `mode` is set, /v1/tools/* answers are hostile."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.mode: str | None = None
        self.app = web.Application()
        self.app.router.add_route("*", "/{tail:.*}", self.handle)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        tool = request.path.removeprefix("/v1/tools/")
        if self.mode is not None and request.path.startswith("/v1/tools/"):
            hostile = await self.hostile(request, tool)
            if hostile is not None:
                return hostile
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization",)}
        async with (
            aiohttp.ClientSession() as http,
            http.request(
                request.method,
                self.upstream + request.path_qs,
                data=await request.read(),
                headers={**headers, "Content-Type": "application/json"},
            ) as resp,
        ):
            body = await resp.read()
            keep = ("Content-Type", "X-Tally-Seq", "X-Tally-Checkpoint")
            out = {k: resp.headers[k] for k in keep if k in resp.headers}
            return web.Response(body=body, status=resp.status, headers=out)

    async def hostile(self, request: web.Request, tool: str) -> web.StreamResponse | None:
        mode = self.mode
        if mode == "deep":
            n = 100_000
            return web.Response(body=b"[" * n + b"]" * n, content_type="application/json")
        if mode == "deep_object":
            n = 100_000
            return web.Response(
                body=b'{"a":' * n + b"1" + b"}" * n, content_type="application/json"
            )
        if mode == "huge":
            return web.Response(body=b'{"x":"' + b"a" * (5 << 20) + b'"}')
        if mode == "silent":
            await asyncio.sleep(30)
        if mode == "drip":  # a byte every 50 ms: each read is quick, the answer never ends
            resp = web.StreamResponse(headers={"Content-Type": "application/json"})
            await resp.prepare(request)
            await resp.write(b'{"x":"')
            for _ in range(600):
                await resp.write(b"a")
                await asyncio.sleep(0.05)
            return resp
        if mode == "error_deep":  # a 500 whose body nests deep and would rewrite a terminal
            n = 100_000
            body = b"\x1b]0;pwned\x07\x1b[2J" + b"[" * n + b"]" * n
            return web.Response(body=body, status=500, content_type="application/json")
        if mode == "redirect":
            raise web.HTTPTemporaryRedirect(self.upstream + request.path_qs)
        if mode == "html" and tool == "ledger_checkpoint":
            return web.Response(body=b"<html>\x1b[31mno</html>", content_type="text/html")
        if mode == "types" and tool == "ledger_checkpoint":
            return web.json_response({"checkpoint": [1, 2, 3]})
        if mode == "nan" and tool == "ledger_checkpoint":
            return web.Response(body=b'{"checkpoint": {"note": NaN}}')
        if mode == "path" and tool == "ledger_proof":
            return web.json_response({"path": {"not": "a list"}})
        if mode == "forged" and tool == "ledger_proof":
            return web.json_response({"path": ["00" * 32] * 3})
        if mode == "entry" and tool == "ledger_get":
            return web.json_response({"seq": "one", "kind": "gateway.reply", "v": 1.5})
        return None


class Setup:
    def __init__(self, second: Daemon, proxy: Proxy, client: TestClient[Any, Any]) -> None:
        self.second = second
        self.proxy = proxy
        self.client = client


@pytest.fixture
async def setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Setup]:
    model = FakeServer(slots=4, n_ctx=4096)
    await model.start()
    (tmp_path / "a").mkdir()
    first = Daemon(settings_for(tmp_path / "a", roster_toml(model.url)))
    await first.start()
    monkeypatch.setenv(TOKEN_ENV, first.clients.add("second", "submit"))
    runner = web.AppRunner(create_app(first, HttpOptions(keepalive_s=0.2)))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    root = f"http://127.0.0.1:{runner.addresses[0][1]}"
    proxy = Proxy(root)
    proxy_runner = web.AppRunner(proxy.app, handler_cancellation=True)
    await proxy_runner.setup()
    await web.TCPSite(proxy_runner, "127.0.0.1", 0).start()
    evil = f"http://127.0.0.1:{proxy_runner.addresses[0][1]}/v1"
    key = first.ledger.vkey
    assert key is not None
    (tmp_path / "b").mkdir()
    second = Daemon(settings_for(tmp_path / "b", _roster(root + "/v1", evil, key)))
    await second.start()
    app = create_app(second, HttpOptions(token="t0ken", keepalive_s=0.2))
    auth = {"Authorization": "Bearer t0ken"}
    try:
        async with TestClient(TestServer(app), headers=auth) as client:
            for lane in ("docs", "backend"):
                view = await second.engine.submit(f"do the {lane}", lane=lane)
                view = await second.engine.wait(view.id, timeout=30)
                assert view.state == "done", view.error
            await first.ledger.checkpoint()
            yield Setup(second, proxy, client)
    finally:
        await second.stop()
        await proxy_runner.cleanup()
        await runner.cleanup()
        await first.stop()
        await model.stop()


async def _verify(client: TestClient[Any, Any]) -> dict[str, Any]:
    resp = await client.post("/v1/tools/ledger_verify_remote", json={})
    assert resp.status == 200, await resp.text()
    data: dict[str, Any] = await resp.json()
    return data


HOSTILE = [
    ("deep", "nests deeper"),
    ("deep_object", "nests deeper"),
    ("huge", "over its limit"),
    ("types", "no checkpoint note"),
    ("nan", "not a JSON number"),
    ("path", "not a list of hex hashes"),
    ("forged", "inclusion proof fails"),
    ("entry", "not a valid ledger entry"),
    ("error_deep", "HTTP 500"),
    ("redirect", "HTTP 307"),
    ("html", "not valid JSON"),
    ("silent", "did not answer within"),
    ("drip", "did not answer within"),
]


async def test_a_hostile_member_fails_its_call_and_the_others_are_checked(
    setup: Setup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One set-up (two daemons, two runs) for every kind of hostile answer, in turn."""
    honest = await _verify(setup.client)
    assert (honest["ok"], honest["failed"]) == (2, 0), honest
    monkeypatch.setattr(daemon.remotes, "_TIMEOUT_S", 0.5)
    for mode, reason in HOSTILE:
        setup.proxy.mode = mode
        report = await _verify(setup.client)
        by_member = {r["member"]: r for r in report["results"]}
        assert by_member["first"]["status"] == "ok", (mode, by_member)
        assert by_member["evil"]["status"] == "failed", (mode, by_member)
        assert reason in by_member["evil"]["reason"], (mode, by_member["evil"])
        assert by_member["evil"]["reason"].isprintable(), (mode, by_member["evil"])
