"""The OpenAI-compatible gateway, driven by the official `openai` SDK over a real TCP socket.

The daemon is real (ledger, pool, HTTP app); its pool members point at the fake llama-server
(`tests.slots.fake_server`), the one stand-in, so faults and timing can be injected. The
same calls against the real embedded model are in `tests/integration/test_gateway_real.py`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web

from daemon.gateway import CALL, REPLY
from daemon.service import Daemon
from surfaces.http import HttpOptions, create_app
from tests.polling import until
from tests.runs.model_server import roster_toml, settings_for
from tests.slots.fake_server import FakeServer

TOKEN = "gateway-test-token"


async def _serve(daemon: Daemon) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(create_app(daemon, HttpOptions(token=TOKEN, keepalive_s=0.2)))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}"


class Setup:
    def __init__(self, daemon: Daemon, base: str, model: FakeServer) -> None:
        self.daemon = daemon
        self.base = base
        self.model = model
        # Any: the SDK's overloads are typed for its own model names and message dicts
        self.sdk: Any = openai.AsyncOpenAI(base_url=base + "/v1", api_key=TOKEN, max_retries=0)

    async def entries(self, kind: str) -> list[Any]:
        return list(await self.daemon.ledger.entries(limit=10_000, kind=kind))

    async def body(self, entry: Any) -> Any:
        return (await self.daemon.ledger.body(entry.body)).value


def _toml(url: str, gateway: str = "") -> str:
    return roster_toml(url) + f"\n[gateway]\n{gateway}\n"


@pytest.fixture
async def model() -> AsyncIterator[FakeServer]:
    server = FakeServer(slots=4, n_ctx=4096)
    await server.start()
    yield server
    server.token_delay_s = 0
    await server.stop()


async def _setup(tmp_path: Path, model: FakeServer, gateway: str = "") -> AsyncIterator[Setup]:
    daemon = Daemon(settings_for(tmp_path, _toml(model.url, gateway)))
    await daemon.start()
    runner, base = await _serve(daemon)
    setup = Setup(daemon, base, model)
    try:
        yield setup
    finally:
        await setup.sdk.close()
        await runner.cleanup()
        await daemon.stop()


@pytest.fixture
async def gw(tmp_path: Path, model: FakeServer) -> AsyncIterator[Setup]:
    async for setup in _setup(tmp_path, model):
        yield setup


def _user(text: str) -> list[Any]:
    return [{"role": "user", "content": text}]


async def test_models_lists_members_tiers_and_lanes(gw: Setup) -> None:
    ids = [m.id async for m in gw.sdk.models.list()]
    assert ids[:2] == ["tiny", "big"]
    assert {"tier:cheap", "tier:capable", "lane:backend", "lane:docs", "lane:testing"} <= set(ids)


async def test_a_reloaded_roster_changes_the_models_and_tiers_served(gw: Setup) -> None:
    text = gw.daemon.roster_path.read_text()
    one_tier = text.replace('ladder = ["cheap", "capable"]', 'ladder = ["cheap"]')
    one_tier = one_tier.replace('capable = ["big"]\n', "")
    gw.daemon.roster_path.write_text(one_tier.replace('name = "big"', 'name = "huge"'))
    await gw.daemon.reload_roster()
    ids = [m.id async for m in gw.sdk.models.list()]
    assert {"tier:cheap", "huge"} <= set(ids)
    assert not {"tier:capable", "big"} & set(ids)
    with pytest.raises(openai.NotFoundError):
        await gw.sdk.chat.completions.create(model="tier:capable", messages=_user("hi"))
    done = await gw.sdk.chat.completions.create(model="tier:cheap", messages=_user("hi"))
    assert done.choices[0].message.content


@pytest.mark.parametrize("model_id", ["tiny", "tier:cheap", "lane:docs"])
async def test_chat_on_a_member_a_tier_and_a_lane_is_witnessed(gw: Setup, model_id: str) -> None:
    raw = await gw.sdk.chat.completions.with_raw_response.create(
        model=model_id, messages=_user("hello there"), max_tokens=5, temperature=0.5
    )
    reply = raw.parse()
    assert reply.choices[0].message.content == "t0 t1 t2 t3 t4 "
    assert reply.model == model_id
    assert reply.usage is not None
    assert reply.usage.completion_tokens == 5
    seq = int(raw.headers["X-Tally-Seq"])
    assert int(raw.headers["X-Tally-Checkpoint"]) >= 0
    [call] = await gw.entries(CALL)
    [answer] = await gw.entries(REPLY)
    assert answer.seq == seq
    assert answer.parent == call.seq
    assert call.actor == "default"
    assert int(raw.headers["X-Tally-Call-Seq"]) == call.seq
    call_body, reply_body = await gw.body(call), await gw.body(answer)
    assert call_body["client"] == "default"
    assert call_body["model"] == model_id
    assert call_body["member"] == "tiny"
    assert isinstance(call_body["slot"], int)
    assert json.loads(call_body["request"])["temperature"] == 0.5
    assert call_body["request_sha256"] == hashlib.sha256(call_body["request"].encode()).hexdigest()
    assert json.loads(reply_body["response"]) == json.loads(raw.content)
    assert reply_body["usage"]["completion_tokens"] == 5
    assert reply_body["error"] is None
    assert reply_body["text_sha256"] == hashlib.sha256(b"t0 t1 t2 t3 t4 ").hexdigest()
    assert reply_body["response_sha256"] == hashlib.sha256(raw.content).hexdigest()
    sent = gw.model.requests[-1]
    assert sent["model"] == "tiny"
    assert sent["cache_prompt"] is True
    assert "id_slot" in sent
    if model_id == "lane:docs":
        assert sent["messages"][0] == {"role": "system", "content": "You do docs work."}
        assert call_body["prepended"] == "You do docs work."
    else:
        assert sent["messages"] == _user("hello there")


async def test_a_stream_ends_with_usage_and_its_ledger_seq(gw: Setup) -> None:
    stream = await gw.sdk.chat.completions.create(
        model="tier:cheap",
        messages=_user("stream please"),
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "t0 t1 t2 t3 "
    last = chunks[-1]
    assert last.usage is not None
    assert last.usage.completion_tokens == 4
    tally = (last.model_extra or {})["tally"]
    [answer] = await gw.entries(REPLY)
    assert tally["seq"] == answer.seq
    body = await gw.body(answer)
    assert body["ttft_us"] is not None
    assert body["ttft_us"] >= 0
    assert body["finish_reason"] == "length"


async def test_a_stream_without_include_usage_has_no_usage_chunk(gw: Setup) -> None:
    stream = await gw.sdk.chat.completions.create(
        model="tiny", messages=_user("x"), max_tokens=2, stream=True
    )
    chunks = [chunk async for chunk in stream]
    assert all(c.usage is None for c in chunks)


async def test_response_format_is_passed_through(gw: Setup) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    reply = await gw.sdk.chat.completions.create(
        model="tiny",
        messages=_user("json"),
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "ok", "schema": schema},
        },
    )
    assert json.loads(reply.choices[0].message.content or "") == {"ok": True}
    assert gw.model.requests[-1]["response_format"]["type"] == "json_schema"


async def test_tools_and_sampling_fields_pass_through(gw: Setup) -> None:
    tool = {
        "type": "function",
        "function": {"name": "f", "parameters": {"type": "object", "properties": {}}},
    }
    await gw.sdk.chat.completions.create(
        model="tiny",
        messages=_user("call f"),
        tools=[tool],
        tool_choice="auto",
        top_p=0.9,
        seed=7,
        stop=["\n\n"],
        max_tokens=2,
    )
    sent = gw.model.requests[-1]
    assert sent["tools"] == [tool]
    assert sent["tool_choice"] == "auto"
    assert sent["top_p"] == 0.9
    assert sent["seed"] == 7
    assert sent["stop"] == ["\n\n"]


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"bogus_field": 1}, "bogus_field"),
        ({"id_slot": 0}, "id_slot"),
        ({"n": 2}, "n"),
        ({"temperature": "hot"}, "temperature"),
        ({"max_tokens": 10**9}, "max_tokens"),
    ],
)
async def test_bad_fields_are_a_400_that_names_them(
    gw: Setup, extra: dict[str, Any], named: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        await gw.sdk.chat.completions.create(model="tiny", messages=_user("x"), extra_body=extra)
    assert named in caught.value.message
    assert gw.model.requests == []
    assert await gw.entries(CALL) == []


async def test_malformed_bodies_get_openai_errors(gw: Setup) -> None:
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    url = gw.base + "/v1/chat/completions"
    async with aiohttp.ClientSession(headers=headers) as http:
        for raw in (b"{", b"[]", b'{"model": "tiny"}', b'{"model": "tiny", "messages": []}'):
            async with http.post(url, data=raw) as resp:
                assert resp.status == 400, raw
                error = (await resp.json())["error"]
                assert error["type"] == "invalid_request_error"
                assert error["message"]
        async with http.post(url, data=b"x" * (2 << 20)) as resp:
            assert resp.status == 413


async def test_unknown_model_is_404(gw: Setup) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        await gw.sdk.chat.completions.create(model="lane:nope", messages=_user("x"))
    assert "does not exist" in caught.value.message


async def test_tokens_and_scopes(gw: Setup) -> None:
    stranger = openai.AsyncOpenAI(base_url=gw.base + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        await stranger.chat.completions.create(model="tiny", messages=_user("x"))
    await stranger.close()
    reader_token = gw.daemon.clients.add("reader", "read")
    reader = openai.AsyncOpenAI(base_url=gw.base + "/v1", api_key=reader_token, max_retries=0)
    assert [m.id async for m in reader.models.list()]
    with pytest.raises(openai.PermissionDeniedError):
        await reader.chat.completions.create(model="tiny", messages=_user("x"))
    await reader.close()
    submitter_token = gw.daemon.clients.add("ide", "submit")
    ide = openai.AsyncOpenAI(base_url=gw.base + "/v1", api_key=submitter_token, max_retries=0)
    await ide.chat.completions.create(model="tiny", messages=_user("x"), max_tokens=1)
    await ide.close()
    [call] = await gw.entries(CALL)
    assert call.actor == "ide"
    assert (await gw.body(call))["client"] == "ide"


async def test_unix_socket_owner_needs_no_token(gw: Setup, tmp_path: Path) -> None:
    path = tmp_path / "gw.sock"
    runner = web.AppRunner(create_app(gw.daemon, HttpOptions(keepalive_s=0.2)))
    await runner.setup()
    await web.UnixSite(runner, str(path)).start()
    try:
        connector = aiohttp.UnixConnector(path=str(path))
        async with aiohttp.ClientSession(connector=connector) as http:
            body = {"model": "tiny", "messages": _user("hi"), "max_tokens": 1}
            async with http.post("http://tally/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
        [call] = await gw.entries(CALL)
        assert call.actor == "owner"
    finally:
        await runner.cleanup()


async def _busy(gw: Setup) -> int:
    status = gw.daemon.pool.status()
    return sum(i.slots_busy for m in status.members for i in m.instances)


async def test_a_full_queue_answers_429_with_retry_after(tmp_path: Path, model: FakeServer) -> None:
    async for gw in _setup(tmp_path, model, "max_waiting = 1"):
        await gw.sdk.chat.completions.create(model="tiny", messages=_user("x"), max_tokens=1)
        model.token_delay_s = 0.05
        slow = [
            asyncio.create_task(
                gw.sdk.chat.completions.create(model="tiny", messages=_user("x"), max_tokens=40)
            )
            for _ in range(5)  # four slots busy, one waiting
        ]
        while await _busy(gw) < 4 or gw.daemon.gateway.waiting < 1:
            await asyncio.sleep(0.01)
        with pytest.raises(openai.RateLimitError) as caught:
            await gw.sdk.chat.completions.create(model="tiny", messages=_user("x"))
        assert int(caught.value.response.headers["Retry-After"]) >= 1
        model.token_delay_s = 0
        await asyncio.gather(*slow)
        assert len(await gw.entries(CALL)) == 6


async def test_a_lease_wait_past_its_deadline_is_504(tmp_path: Path, model: FakeServer) -> None:
    async for gw in _setup(tmp_path, model, "queue_timeout_s = 0.2"):
        await gw.sdk.chat.completions.create(model="tiny", messages=_user("x"), max_tokens=1)
        model.token_delay_s = 0.05
        slow = [
            asyncio.create_task(
                gw.sdk.chat.completions.create(model="tiny", messages=_user("x"), max_tokens=40)
            )
            for _ in range(4)
        ]
        while await _busy(gw) < 4:
            await asyncio.sleep(0.01)
        with pytest.raises(openai.APIStatusError) as caught:
            await gw.sdk.chat.completions.create(model="tiny", messages=_user("x"))
        assert caught.value.status_code == 504
        model.token_delay_s = 0
        await asyncio.gather(*slow)


def _freed(gw: Setup) -> Callable[[], Awaitable[bool]]:
    async def freed() -> bool:
        return not await _busy(gw) and not gw.model.processing

    return freed


async def test_a_client_leaving_mid_stream_frees_its_slot(gw: Setup) -> None:
    gw.model.token_delay_s = 0.05
    stream = await gw.sdk.chat.completions.create(
        model="tiny", messages=_user("long"), max_tokens=400, stream=True
    )
    async for _chunk in stream:
        break
    assert await _busy(gw) == 1
    await stream.close()
    # Freed by the disconnect: the model would stream for 20 s more (400 tokens at 50 ms).
    await until(_freed(gw), timeout=10, what="the slot freed after the client left")
    answer = (await gw.entries(REPLY))[-1]
    assert "client disconnected" in (await gw.body(answer))["error"]


async def test_a_client_leaving_a_non_streamed_call_frees_its_slot(gw: Setup) -> None:
    gw.model.token_delay_s = 0.05
    task = asyncio.create_task(
        gw.sdk.chat.completions.create(model="tiny", messages=_user("long"), max_tokens=400)
    )
    while not await _busy(gw):
        await asyncio.sleep(0.01)
    task.cancel()  # the SDK closes its connection
    # Freed by the disconnect: the model would answer for 20 s more (400 tokens at 50 ms).
    await until(_freed(gw), timeout=10, what="the slot freed after the client left")
    answer = (await gw.entries(REPLY))[-1]
    assert (await gw.body(answer))["error"] == "client disconnected (cancelled)"
    # the next call is served as usual
    done = await gw.sdk.chat.completions.create(model="tiny", messages=_user("hi"), max_tokens=2)
    assert done.choices[0].message.content


async def test_a_crash_before_the_first_token_is_retried(gw: Setup) -> None:
    gw.model.crash_after = 0
    reply = await gw.sdk.chat.completions.create(
        model="tiny", messages=_user("x"), max_tokens=3, stream=True
    )
    text = "".join([c.choices[0].delta.content or "" async for c in reply if c.choices])
    assert text == "t0 t1 t2 "
    calls = [await gw.body(e) for e in await gw.entries(CALL)]
    assert [c["attempt"] for c in calls] == [1, 2]
    replies = [await gw.body(e) for e in await gw.entries(REPLY)]
    assert replies[0]["error"]
    assert replies[1]["error"] is None


async def test_a_crash_mid_stream_is_a_clean_error(gw: Setup) -> None:
    gw.model.crash_after = 2
    stream = await gw.sdk.chat.completions.create(
        model="tiny", messages=_user("x"), max_tokens=10, stream=True
    )
    got: list[str] = []

    async def read() -> None:
        async for chunk in stream:
            got.append(chunk.choices[0].delta.content or "" if chunk.choices else "")

    with pytest.raises(openai.APIError) as caught:
        await read()
    assert "lost" in str(caught.value.message)
    # what was already relayed stays relayed; tokens buffered when the connection broke are lost
    assert "t0 t1 ".startswith("".join(got))
    assert got
    # the next call succeeds
    ok = await gw.sdk.chat.completions.create(model="tiny", messages=_user("x"), max_tokens=1)
    assert ok.choices[0].message.content == "t0 "


async def test_a_lane_climbs_a_tier_after_a_failed_attempt(gw: Setup) -> None:
    gw.model.fail_next = 1
    reply = await gw.sdk.chat.completions.create(
        model="lane:backend", messages=_user("x"), max_tokens=1
    )
    assert reply.choices[0].message.content == "t0 "
    calls = [await gw.body(e) for e in await gw.entries(CALL)]
    assert [c["target"] for c in calls] == ["lane:cheap", "lane:capable"]
    assert [c["member"] for c in calls] == ["tiny", "big"]


async def test_a_follow_up_turn_keeps_its_slot(gw: Setup) -> None:
    first = _user("my project is a parser")
    other = _user("something else entirely")
    await gw.sdk.chat.completions.create(model="tiny", messages=first, max_tokens=2)
    await gw.sdk.chat.completions.create(model="tiny", messages=other, max_tokens=2)
    follow = [*first, {"role": "assistant", "content": "t0 t1 "}, *_user("and now?")]
    await gw.sdk.chat.completions.create(model="tiny", messages=follow, max_tokens=2)
    calls = [await gw.body(e) for e in await gw.entries(CALL)]
    assert calls[0]["affinity"] == calls[2]["affinity"] != calls[1]["affinity"]
    assert calls[0]["slot"] == calls[2]["slot"] != calls[1]["slot"]
    reply = await gw.body((await gw.entries(REPLY))[2])
    assert reply["usage"]["cached_tokens"] > 0  # the fake server's KV cache held the prefix


async def test_hashes_only_keeps_no_content(tmp_path: Path, model: FakeServer) -> None:
    async for gw in _setup(tmp_path, model, 'bodies = "hashes"'):
        raw = await gw.sdk.chat.completions.with_raw_response.create(
            model="tiny", messages=_user("secret words"), max_tokens=2
        )
        [call], [answer] = await gw.entries(CALL), await gw.entries(REPLY)
        call_body, reply_body = await gw.body(call), await gw.body(answer)
        assert call_body["request"] is None
        assert reply_body["response"] is None
        assert call_body["request_bytes"] > 0
        assert reply_body["response_sha256"] == hashlib.sha256(raw.content).hexdigest()
        for path in (gw.daemon.settings.state_dir).rglob("*"):
            if path.is_file():
                assert b"secret words" not in path.read_bytes(), path


async def test_metrics_and_summary_count_calls_by_client_and_model(gw: Setup) -> None:
    for _ in range(2):
        await gw.sdk.chat.completions.create(model="tier:cheap", messages=_user("x"), max_tokens=3)
    stream = await gw.sdk.chat.completions.create(
        model="tiny", messages=_user("y"), max_tokens=2, stream=True
    )
    [_ async for _ in stream]
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with aiohttp.ClientSession(headers=headers) as http:
        async with http.get(gw.base + "/metrics") as resp:
            text = await resp.text()
        async with http.post(gw.base + "/v1/tools/ledger_summary", json={}) as resp:
            summary = await resp.json()
    labels = 'client="default",model="tier:cheap"'
    assert f"tally_gateway_calls_total{{{labels}}} 2" in text
    assert f'tally_gateway_tokens_total{{{labels},kind="completion"}} 6' in text
    assert f'tally_gateway_latency_seconds_bucket{{{labels},le="+Inf"}} 2' in text
    assert 'tally_gateway_ttft_seconds_count{client="default",model="tiny"} 1' in text
    assert "# TYPE tally_event_loop_lag_seconds histogram" in text
    assert 'tally_event_loop_lag_seconds_bucket{le="+Inf"}' in text
    usage = summary["gateway"]["default"]
    assert usage["tier:cheap"]["calls"] == 2
    assert usage["tier:cheap"]["completion_tokens"] == 6
    assert usage["tiny"]["calls"] == 1


async def test_embeddings_pass_through_and_are_witnessed(gw: Setup) -> None:
    raw = await gw.sdk.embeddings.with_raw_response.create(
        model="tier:cheap", input=["one two", "three"]
    )
    result = raw.parse()
    assert [len(d.embedding) for d in result.data] == [3, 3]
    assert result.model == "tier:cheap"
    assert result.usage.prompt_tokens == 3
    assert gw.model.requests[-1]["model"] == "tiny"
    [call], [answer] = await gw.entries(CALL), await gw.entries(REPLY)
    assert int(raw.headers["X-Tally-Seq"]) == answer.seq
    assert (await gw.body(call))["endpoint"] == "embeddings"
    assert (await gw.body(answer))["response_sha256"] == hashlib.sha256(raw.content).hexdigest()
    with pytest.raises(openai.BadRequestError):
        await gw.sdk.embeddings.create(model="tiny", input="x", extra_body={"nope": 1})
