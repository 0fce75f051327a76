"""A hostile member cannot take the daemon down: every reply it sends is bounded.

The real daemon (ledger, pool, gateway, HTTP app) in front of the fake llama-server in a
hostile mode (`tests.slots.fake_server`, POST /_fault): a 400 MiB reply with an honest
Content-Length (made as it is sent: nothing in this process ever holds it), the same without a
length, a stream that floods text, JSON nested 100k deep, a stream that drips for ever. Each
call fails as the member's fault — witnessed as a failed `gateway.reply`, shown as the member's
`last_error` in `slots` — and the daemon answers the next request.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from daemon.errors import TallyError
from daemon.gateway import REPLY
from daemon.service import Daemon
from tests.slots.fake_server import FakeServer

MIB = 2**20


def _rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM starts again from VmRSS


async def _fault(model: FakeServer, **mode: Any) -> None:
    import aiohttp

    async with aiohttp.ClientSession() as http, http.post(model.url + "/_fault", json=mode) as r:
        assert r.status == 200


async def _chat(client: TestClient[Any, Any], stream: bool = False) -> tuple[int, Any]:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
    if stream:
        body["stream"] = True
    resp = await client.post("/v1/chat/completions", json=body)
    text = await resp.text()
    if stream:
        return resp.status, text
    return resp.status, json.loads(text)


async def _failed_replies(daemon: Daemon) -> list[dict[str, Any]]:
    out = []
    for entry in await daemon.ledger.entries(limit=100, kind=REPLY):
        body = (await daemon.ledger.body(entry.body)).value
        if body["error"] is not None:
            out.append(body)
    return out


async def _next_call_answers(model: FakeServer, client: TestClient[Any, Any]) -> None:
    model.hostile_left = 0
    status, body = await _chat(client)
    assert status == 200, body
    assert body["choices"][0]["message"]["content"].startswith("t0")


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_a_400_mib_reply_fails_the_call_and_the_daemon_lives(
    daemon: Daemon, model: FakeServer, client: TestClient[Any, Any], chunked: bool
) -> None:
    await _fault(model, mode="huge", bytes=400 * MIB, chunked=chunked, count=2)
    before = _rss_kb("VmRSS")
    _reset_peak()
    started = time.monotonic()
    status, body = await _chat(client)
    grew_mb = (_rss_kb("VmHWM") - before) / 1024
    assert time.monotonic() - started < 10
    assert status == 502, body
    assert body["error"]["code"] == "reply_too_large"
    assert "over its limit of" in body["error"]["message"]
    print(f"RSS high-water grew {grew_mb:.1f} MB")
    assert grew_mb < 100, f"RSS grew {grew_mb:.0f} MB"
    # both attempts (the gateway retries once) are witnessed as failed calls of the member
    failed = await _failed_replies(daemon)
    assert len(failed) == 2
    assert all("over its limit" in f["error"] and f["member"] == "tiny" for f in failed)
    member = daemon.pool.status().member("tiny")
    assert member is not None
    assert member.last_error is not None
    assert "over its limit" in member.last_error
    await _next_call_answers(model, client)


async def test_a_flooding_stream_is_cut_at_the_cap(
    daemon: Daemon, model: FakeServer, client: TestClient[Any, Any]
) -> None:
    await _fault(model, mode="flood", bytes=64 * MIB, count=2)
    status, text = await _chat(client, stream=True)
    # the first 64 KiB delta was within the cap (max_tokens 16: 128 KiB) and reached the
    # client; the second crossed it, so the stream ends with the error in-band
    assert status == 200
    assert len(text) < 512 * 1024
    assert '"code":"reply_too_large"' in text, text[-500:]
    assert "data: [DONE]" not in text
    failed = await _failed_replies(daemon)
    assert failed
    assert all("over its limit" in f["error"] for f in failed)
    await _next_call_answers(model, client)


async def test_json_nested_50k_deep_is_a_bad_reply(
    daemon: Daemon, model: FakeServer, client: TestClient[Any, Any]
) -> None:
    await _fault(model, mode="deep", depth=50_000, count=2)  # 100 KB: under the cap
    status, body = await _chat(client)
    assert status == 502, body
    assert body["error"]["code"] == "bad_reply"
    assert "nests deeper" in body["error"]["message"]
    assert len(await _failed_replies(daemon)) == 2
    await _next_call_answers(model, client)


async def test_a_reply_that_drips_ends_at_its_total_deadline(
    tmp_path: Path, model: FakeServer
) -> None:
    """A `tally = true` member that streams a token every 50 ms for ever: each chunk comes
    well within any per-read timeout, so only a deadline for the whole call ends it; the
    daemon's other calls go on meanwhile."""
    from tests.runs.model_server import settings_for
    from tests.surfaces.conftest import roster_toml

    key = "first+00000000+" + "A" * 43 + "="
    text = roster_toml(model.url).replace(
        'name = "tiny"\n', f'name = "tiny"\ntally = true\ntally_key = "{key}"\n'
    )
    text = text.replace("slots = 4\n", "slots = 4\nrequest_timeout_s = 1.0\n", 1)
    daemon = Daemon(settings_for(tmp_path, text))
    await daemon.start()
    try:
        from daemon.clients import OWNER as owner

        async def call(model_id: str, stream: bool) -> tuple[float, str | None]:
            """(seconds, the error that ended it or None)."""
            body = {"model": model_id, "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 8, "stream": stream}  # fmt: skip
            started = time.monotonic()

            async def nowhere(_: Any) -> None:
                return None

            error = None
            try:
                answer = await daemon.gateway.chat(
                    owner, json.dumps(body).encode(), nowhere, nowhere
                )
                if not answer.ok:
                    error = "ended in-band"  # a stream already begun ends with an error chunk
            except TallyError as err:
                error = err.message
            return time.monotonic() - started, error

        await _fault(model, mode="drip", interval=0.05, count=1)
        dripping = asyncio.ensure_future(call("tiny", stream=True))
        await asyncio.sleep(0.2)
        other, error = await call("big", stream=False)  # another member, while tiny drips
        assert error is None
        assert other < 1.0
        took, error = await dripping
        assert error is not None
        # the attempt ends at the member's 1 s deadline (its retry finds tiny unhealthy)
        assert 1.0 <= took < 4.0, took
        failed = await _failed_replies(daemon)
        assert failed
        assert all("hung" in f["error"] for f in failed), failed
    finally:
        await daemon.stop()


async def test_a_run_whose_member_floods_fails_witnessed(daemon: Daemon, model: FakeServer) -> None:
    """The engine's calls read through the same bounds: each failed call is a `model.reply`
    with the error, and the run ends failed instead of the daemon."""
    from daemon.runs import entries as k

    await _fault(model, mode="huge", bytes=400 * MIB, count=50)
    view = await daemon.engine.submit("build the api", lane="backend")
    view = await daemon.engine.wait(view.id, timeout=30)
    assert view.state == "failed", view
    replies = await daemon.ledger.entries(limit=100, kind=k.MODEL_REPLY, run=view.id)
    errors = [(await daemon.ledger.body(r.body)).value["error"] for r in replies]
    assert errors
    assert all(e is not None and "over its limit" in e for e in errors), errors
    model.hostile_left = 0
    again = await daemon.engine.wait((await daemon.engine.submit("build the api")).id, 30)
    assert again.state == "done", again.error


async def test_a_400_mib_embeddings_answer_fails_at_the_members_ceiling(
    daemon: Daemon, model: FakeServer, client: TestClient[Any, Any]
) -> None:
    await _fault(model, mode="huge", bytes=400 * MIB, chunked=True, embeddings=True, count=1)
    before = _rss_kb("VmRSS")
    _reset_peak()
    resp = await client.post("/v1/embeddings", json={"model": "tiny", "input": "hello"})
    body = await resp.json()
    grew_mb = (_rss_kb("VmHWM") - before) / 1024
    assert resp.status == 502, body
    assert body["error"]["code"] == "reply_too_large"
    assert str(16 * MIB) in body["error"]["message"]  # max_reply_mb's default
    assert grew_mb < 100, f"RSS grew {grew_mb:.0f} MB"
    [failed] = await _failed_replies(daemon)
    assert "over its limit" in failed["error"]
    resp = await client.post("/v1/embeddings", json={"model": "tiny", "input": "hello"})
    assert resp.status == 200, await resp.text()


async def test_a_reply_small_in_bytes_but_huge_parsed_is_a_bad_reply(
    daemon: Daemon, model: FakeServer, client: TestClient[Any, Any]
) -> None:
    # 15 MiB of `[],` (under the 16 MiB ceiling of a call with no max_tokens) is 5.2M lists:
    # about 400 MB once parsed. Refused by its count of values, before parsing.
    await _fault(model, mode="wide", bytes=15 * MIB, count=2)
    before = _rss_kb("VmRSS")
    _reset_peak()
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
    resp = await client.post("/v1/chat/completions", json=body)
    answer = await resp.json()
    grew_mb = (_rss_kb("VmHWM") - before) / 1024
    print(f"RSS high-water grew {grew_mb:.1f} MB")
    assert resp.status == 502, answer
    assert answer["error"]["code"] == "bad_reply"
    assert "JSON values" in answer["error"]["message"]
    assert grew_mb < 150, f"RSS grew {grew_mb:.0f} MB"
    assert len(await _failed_replies(daemon)) == 2
    await _next_call_answers(model, client)


async def test_tool_call_deltas_without_an_index_cannot_grow_without_bound(
    daemon: Daemon, model: FakeServer, client: TestClient[Any, Any]
) -> None:
    # each `{}` in a delta's tool_calls (no index) would open one more call, counted as nothing
    await _fault(model, mode="calls", per=1000, count=2, stream_only=True)
    started = time.monotonic()
    status, text = await _chat(client, stream=True)
    assert time.monotonic() - started < 10
    assert status in (200, 502)  # 502 when its first chunk already crossed the bound
    assert "more than 128 tool calls" in text, text[-500:]
    assert "data: [DONE]" not in text
    failed = await _failed_replies(daemon)
    assert failed
    assert all("128 tool calls" in f["error"] for f in failed)
    await _next_call_answers(model, client)


async def test_a_redirect_is_not_followed_to_another_port(
    daemon: Daemon, model: FakeServer, client: TestClient[Any, Any]
) -> None:
    """A member's 307 would re-send the prompt to wherever it points (another local service)."""
    from aiohttp import web

    caught: list[str] = []

    async def catch(request: web.Request) -> web.Response:
        caught.append(await request.text())
        return web.json_response({})

    app = web.Application()
    app.router.add_route("*", "/{path:.*}", catch)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        for stream in (False, True):
            await _fault(model, mode="redirect", to=f"http://127.0.0.1:{port}/steal", count=2)
            status, answer = await _chat(client, stream=stream)
            assert status == 502, answer
            assert "a redirect to" in str(answer), answer
        assert caught == []
        failed = await _failed_replies(daemon)
        assert len(failed) == 4
        assert all("not followed" in f["error"] for f in failed)
        await _next_call_answers(model, client)
    finally:
        await runner.cleanup()


@pytest.mark.parametrize("size", [16 * 1024, 0], ids=["junk-fields", "blank-lines"])
async def test_a_stream_of_chunks_that_keep_nothing_is_cut_at_the_cap(
    daemon: Daemon, model: FakeServer, client: TestClient[Any, Any], size: int
) -> None:
    """Empty deltas with a junk field (relayed to the gateway's client, never kept) or blank
    lines, for ever: every line counts against the cap (max_tokens 16: 128 KiB), or the
    member keeps the daemon's loop busy parsing and relaying until the 300 s timeout."""
    await _fault(model, mode="junk", bytes=size, count=2, stream_only=True)
    started = time.monotonic()
    status, text = await _chat(client, stream=True)
    assert time.monotonic() - started < 10
    assert status in (200, 502)
    assert "reply_too_large" in text, text[-300:]
    assert len(text) < 512 * 1024
    failed = await _failed_replies(daemon)
    assert failed
    assert all("over its limit" in f["error"] for f in failed)
    await _next_call_answers(model, client)
