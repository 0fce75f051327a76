"""The gateway's everyday features beside LiteLLM's: fallbacks across models, per-client rate
limits and token budgets, errors in OpenAI's shape everywhere, a published description, and
counts that say what they count.

The daemon, its HTTP app and the official `openai` SDK are real; pool members point at the
fake llama-server (`tests.slots.fake_server`), and one at a closed port (a member that is down).
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import jsonschema
import openai
import pytest
from aiohttp import web
from openapi_spec_validator import validate

from daemon.clients import Limits
from daemon.gateway import CALL, FALLBACK, LIMITED, REPLY
from daemon.service import Daemon
from surfaces.http import HttpOptions, create_app
from tests.runs.model_server import settings_for
from tests.slots.fake_server import FakeServer

TOKEN = "parity-test-token"


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _roster(live: str, dead: str, gateway: str = "") -> str:
    return f"""version = 1
[policy]
max_parallel = 4

[[models]]
name = "tiny"
url = "{live}"
slots = 4

[[models]]
name = "gone"
url = "{dead}"
slots = 1

[tiers]
ladder = ["cheap", "capable"]
cheap = ["tiny"]
capable = ["gone"]

[[lanes]]
name = "backend"
keywords = ["backend"]
tier = "cheap"
system = "You do backend work."

[gateway]
retries = 0
{gateway}
"""


class Setup:
    def __init__(self, daemon: Daemon, base: str, model: FakeServer) -> None:
        self.daemon, self.base, self.model = daemon, base, model
        self.sdk: Any = openai.AsyncOpenAI(base_url=base + "/v1", api_key=TOKEN, max_retries=0)

    async def entries(self, kind: str) -> list[Any]:
        return list(await self.daemon.ledger.entries(limit=10_000, kind=kind))

    async def body(self, entry: Any) -> Any:
        return (await self.daemon.ledger.body(entry.body)).value

    def client(self, token: str, retries: int = 0) -> Any:
        return openai.AsyncOpenAI(base_url=self.base + "/v1", api_key=token, max_retries=retries)


@pytest.fixture
async def model() -> AsyncIterator[FakeServer]:
    server = FakeServer(slots=4, n_ctx=4096)
    await server.start()
    yield server
    await server.stop()


async def _setup(tmp_path: Path, model: FakeServer, gateway: str = "") -> AsyncIterator[Setup]:
    dead = f"http://127.0.0.1:{_closed_port()}/v1"
    daemon = Daemon(settings_for(tmp_path, _roster(model.url, dead, gateway)))
    await daemon.start()
    runner = web.AppRunner(create_app(daemon, HttpOptions(token=TOKEN, keepalive_s=0.2)))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    setup = Setup(daemon, f"http://127.0.0.1:{runner.addresses[0][1]}", model)
    try:
        yield setup
    finally:
        await setup.sdk.close()
        await runner.cleanup()
        await daemon.stop()


@pytest.fixture
async def gw(tmp_path: Path, model: FakeServer) -> AsyncIterator[Setup]:
    fallbacks = 'fallbacks = { gone = ["tier:capable", "lane:backend"], "tier:capable" = ["tiny"] }'
    async for setup in _setup(tmp_path, model, fallbacks):
        yield setup


def _user(text: str) -> list[Any]:
    return [{"role": "user", "content": text}]


# ---------------------------------------------------------------- fallbacks


async def test_a_dead_member_falls_back_in_order_each_try_witnessed(gw: Setup) -> None:
    answer = await gw.sdk.chat.completions.with_raw_response.create(
        model="gone", messages=_user("hello"), max_tokens=2
    )
    completion = answer.parse()
    assert completion.choices[0].message.content
    assert completion.model == "gone"  # the id asked for, as before; the record says who served
    # gone -> tier:capable (the same dead member) -> lane:backend, which serves
    switches = [await gw.body(e) for e in await gw.entries(FALLBACK)]
    assert [(s["failed"], s["next"]) for s in switches] == [
        ("gone", "tier:capable"),
        ("tier:capable", "lane:backend"),
    ]
    assert all(s["client"] == "default" and s["model"] == "gone" for s in switches)
    assert all(s["error"] and s["code"] for s in switches)
    [call] = [await gw.body(e) for e in await gw.entries(CALL)]
    assert call["target"] == "lane:cheap"
    assert call["member"] == "tiny"
    [reply] = await gw.entries(REPLY)
    assert int(answer.headers["X-Tally-Seq"]) == reply.seq
    # the lane's system prompt went first, as a call to lane:backend does
    assert gw.model.requests[-1]["messages"][0]["content"] == "You do backend work."


async def test_a_stream_falls_back_before_its_first_byte(gw: Setup) -> None:
    stream = await gw.sdk.chat.completions.create(
        model="tier:capable", messages=_user("x"), max_tokens=3, stream=True
    )
    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text
    [switch] = [await gw.body(e) for e in await gw.entries(FALLBACK)]
    assert (switch["failed"], switch["next"]) == ("tier:capable", "tiny")


async def test_without_fallbacks_a_dead_member_is_still_an_error(
    tmp_path: Path, model: FakeServer
) -> None:
    async for setup in _setup(tmp_path, model):
        with pytest.raises(openai.APIStatusError) as caught:
            await setup.sdk.chat.completions.create(model="gone", messages=_user("x"))
        assert caught.value.status_code in (502, 503)
        assert caught.value.body["type"] == "server_error"  # type: ignore[index]
        assert await setup.entries(FALLBACK) == []


async def test_bad_fallbacks_are_located_roster_errors(tmp_path: Path, model: FakeServer) -> None:
    from roster.loading import RosterError, load_roster_text

    text = _roster(model.url, model.url, 'fallbacks = { gone = ["tier:nope", "gone"] }')
    with pytest.raises(RosterError) as caught:
        load_roster_text(text)
    message = str(caught.value)
    assert "gateway.fallbacks.gone[0]" in message or "gateway.fallbacks.gone.0" in message
    assert "tier:nope" in message
    assert "listed twice" in message


# ---------------------------------------------------------------- limits and budgets


async def test_the_61st_request_in_a_minute_is_a_429_the_sdk_retries(gw: Setup) -> None:
    token = gw.daemon.clients.add("ide", "submit", Limits(rpm=60))
    ide = gw.client(token)
    for _ in range(60):
        await ide.chat.completions.create(model="tiny", messages=_user("x"), max_tokens=1)
    served = len(gw.model.requests)
    with pytest.raises(openai.RateLimitError) as caught:
        await ide.chat.completions.create(model="tiny", messages=_user("x"), max_tokens=1)
    refusal = caught.value
    assert refusal.status_code == 429
    assert refusal.body["type"] == "rate_limit_error"  # type: ignore[index]
    assert refusal.body["code"] == "rate_limit_exceeded"  # type: ignore[index]
    assert "rpm" in refusal.message
    assert "60" in refusal.message
    retry_after = int(refusal.response.headers["Retry-After"])
    assert 1 <= retry_after <= 60
    assert int(refusal.response.headers["retry-after-ms"]) <= retry_after * 1000
    assert len(gw.model.requests) == served  # refused before any model saw it
    # Move the limiter's clock to about a second before the window frees: the SDK's own retry
    # reads retry-after-ms, waits it out and gets through.
    wait_ms = int(refusal.response.headers["retry-after-ms"])
    real = gw.daemon.quotas.clock
    gw.daemon.quotas.clock = lambda: real() + (wait_ms - 900) / 1000
    patient = gw.client(token, retries=2)
    started = time.monotonic()
    done = await patient.chat.completions.create(model="tiny", messages=_user("x"), max_tokens=1)
    assert done.choices
    assert 0.5 < time.monotonic() - started < 10
    await ide.close()
    await patient.close()
    [limited] = [await gw.body(e) for e in await gw.entries(LIMITED)]  # once a minute, not per 429
    assert limited["client"] == "ide"
    assert limited["limit"] == "rpm"
    assert limited["allowed"] == 60
    assert limited["surface"] == "chat.completions"


async def test_a_token_budget_holds_across_the_gateway_runs_and_a_restart(
    tmp_path: Path, model: FakeServer
) -> None:
    async for gw in _setup(tmp_path, model):
        token = gw.daemon.clients.add("batch", "submit", Limits(tokens_per_day=40))
        batch = gw.client(token)
        spent = 0
        while spent < 40:  # each call is its prompt's words + 4 completion tokens
            done = await batch.chat.completions.create(
                model="tiny", messages=_user("count these words"), max_tokens=4
            )
            spent += done.usage.total_tokens
        with pytest.raises(openai.RateLimitError) as caught:
            await batch.chat.completions.create(model="tiny", messages=_user("x"), max_tokens=1)
        assert "tokens_per_day" in caught.value.message
        assert " h " in caught.value.message  # a day's wait in hours, not only 86000 s
        assert int(caught.value.response.headers["Retry-After"]) > 3600  # a day's window
        # runs count against the same budget: a submit is refused the same way
        headers = {"Authorization": f"Bearer {token}"}
        async with (
            aiohttp.ClientSession(headers=headers) as http,
            http.post(gw.base + "/v1/tools/submit", json={"request": "backend work"}) as resp,
        ):
            assert resp.status == 429
            assert int(resp.headers["Retry-After"]) > 3600
            assert (await resp.json())["error"]["code"] == "rate_limited"
        await batch.close()
    # a restart rebuilds the day's usage from the record
    async for gw in _setup(tmp_path, model):
        assert gw.daemon.quotas.snapshot("batch")["tokens_day"] >= 40
        token_client = gw.daemon.clients.lookup(token)
        assert token_client is not None
        assert gw.daemon.quotas.check(token_client) is not None


async def test_a_runs_tokens_count_for_its_client(gw: Setup) -> None:
    token = gw.daemon.clients.add("runner", "submit", Limits(tpm=1_000_000))
    body = {"request": "backend work", "wait": True}
    async with (
        aiohttp.ClientSession(headers={"Authorization": f"Bearer {token}"}) as http,
        http.post(gw.base + "/v1/tools/submit", json=body) as resp,
    ):
        run = await resp.json()
        assert resp.status == 200, run
        assert run["state"] == "done", run
    used = gw.daemon.quotas.snapshot("runner")
    assert used["requests_minute"] == 1
    assert used["tokens_minute"] == run["spent"]["tokens"] > 0


async def test_client_list_and_metrics_show_limits_and_use(gw: Setup) -> None:
    token = gw.daemon.clients.add("ide", "submit", Limits(rpm=5, tokens_per_day=100_000))
    ide = gw.client(token)
    await ide.chat.completions.create(model="tiny", messages=_user("x"), max_tokens=2)
    await ide.close()
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with aiohttp.ClientSession(headers=headers) as http:
        async with http.post(gw.base + "/v1/tools/client_list", json={}) as resp:
            [listed] = (await resp.json())["clients"]
        async with http.get(gw.base + "/metrics") as resp:
            metrics = await resp.text()
    assert listed["limits"] == {"rpm": 5, "tpm": None, "tokens_per_day": 100_000}
    assert listed["used"]["requests_minute"] == 1
    assert listed["used"]["tokens_day"] > 0
    assert 'tally_client_limit{client="ide",limit="rpm"} 5' in metrics
    assert 'tally_client_usage{client="ide",window="requests_minute"} 1' in metrics


# ---------------------------------------------------------------- errors in OpenAI's shape


def _openai_shaped(body: Any) -> dict[str, Any]:
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, body
    assert isinstance(error["message"], str)
    assert error["message"]
    return dict(error)


async def test_every_gateway_error_is_in_openais_shape(gw: Setup) -> None:
    base = gw.base
    async with aiohttp.ClientSession() as http:
        async with http.post(base + "/v1/chat/completions", json={}) as resp:
            assert resp.status == 401
            refused = _openai_shaped(await resp.json())
            assert refused["code"] == "invalid_api_key"
            assert "--scope submit" in refused["message"]  # what the gateway needs, not `read`
            assert resp.headers["WWW-Authenticate"].startswith("Bearer")
        async with http.get(base + "/v1/models") as resp:
            assert resp.status == 401
            _openai_shaped(await resp.json())
        auth = {"Authorization": f"Bearer {TOKEN}"}
        async with http.get(base + "/v1/chat/completions", headers=auth) as resp:
            assert resp.status == 405
            assert "POST" in resp.headers["Allow"]
            _openai_shaped(await resp.json())
        async with http.post(
            base + "/v1/chat/completions", headers={**auth, "Host": "evil.example"}, json={}
        ) as resp:
            assert resp.status == 421
            _openai_shaped(await resp.json())
        big = b'{"model": "tiny", "messages": [' + b" " * (2 << 20) + b"]}"
        async with http.post(
            base + "/v1/chat/completions",
            headers={**auth, "Content-Type": "application/json"},
            data=big,
        ) as resp:
            assert resp.status == 413
            _openai_shaped(await resp.json())
    # the SDK maps them to its own error types
    stranger = gw.client("wrong")
    with pytest.raises(openai.AuthenticationError) as caught:
        await stranger.models.list()
    assert caught.value.body["type"] == "invalid_request_error"  # type: ignore[index]
    await stranger.close()


async def test_a_members_own_error_message_reaches_the_client(gw: Setup) -> None:
    gw.model.embeddings_off = True
    with pytest.raises(openai.APIStatusError) as caught:
        await gw.sdk.embeddings.create(model="tiny", input="x")
    assert caught.value.status_code == 501
    assert "--embeddings" in caught.value.message
    assert _openai_shaped({"error": caught.value.body})["type"] == "server_error"
    gw.model.fail_next, gw.model.fail_status = 1, 400
    with pytest.raises(openai.BadRequestError) as bad:
        await gw.sdk.chat.completions.create(model="tiny", messages=_user("x"), max_tokens=1)
    assert "injected" in bad.value.message


# ---------------------------------------------------------------- published, and counted


async def test_the_gateway_is_in_openapi_and_its_schema_is_the_checked_one(gw: Setup) -> None:
    async with (
        aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as http,
        http.get(gw.base + "/openapi.json") as resp,
    ):
        document = await resp.json()
    validate(document)
    chat = document["paths"]["/v1/chat/completions"]["post"]
    assert {"200", "401", "429", "503"} <= set(chat["responses"])
    schemas = document["components"]["schemas"]
    request = {"model": "tiny", "messages": _user("hi"), "max_tokens": 2, "stream": False}
    resolver = {"components": {"schemas": schemas}, **schemas["ChatRequest"]}
    jsonschema.validate(request, resolver)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**request, "nope": 1}, resolver)
    assert "/v1/models" in document["paths"]
    assert "/v1/embeddings" in document["paths"]


async def test_summary_and_metrics_count_the_same_things(gw: Setup) -> None:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with aiohttp.ClientSession(headers=headers) as http:
        for request in ("backend one", "backend two"):
            async with http.post(
                gw.base + "/v1/tools/submit", json={"request": request, "wait": True}
            ) as resp:
                assert (await resp.json())["state"] == "done"
        for _ in range(3):
            await gw.sdk.chat.completions.create(model="tiny", messages=_user("x"), max_tokens=1)
        with pytest.raises(openai.APIStatusError):
            await gw.sdk.chat.completions.create(model="lane:backend", messages=[])
        async with http.post(gw.base + "/v1/tools/ledger_summary", json={}) as resp:
            summary = await resp.json()
        async with http.get(gw.base + "/metrics") as resp:
            metrics = await resp.text()
    run_calls = summary["model_calls"]
    assert run_calls == summary["by_kind"]["model.call"] >= 2
    assert f"tally_model_calls_total {run_calls}" in metrics
    assert summary["gateway_calls"] == 3
    answered = [
        line for line in metrics.splitlines() if line.startswith("tally_gateway_calls_total{")
    ]
    assert sum(int(line.rsplit(" ", 1)[1]) for line in answered) == 3
    assert "model.call entries" in metrics  # the help text says what is counted
    assert json.dumps(summary)  # serialisable as the CLI prints it
