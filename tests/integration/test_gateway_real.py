"""The gateway over the real embedded pool (xllamacpp + SmolLM2), driven by the `openai` SDK.

One daemon per test on the packaged default roster, served over TCP with its token.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest
from aiohttp import web

from daemon.config import Settings
from daemon.gateway import CALL, REPLY
from daemon.service import Daemon
from surfaces.http import HttpOptions, create_app

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TOKEN = "real-gateway-token"


class Real:
    def __init__(self, daemon: Daemon, sdk: Any) -> None:
        self.daemon = daemon
        self.sdk = sdk

    async def bodies(self, kind: str) -> list[Any]:
        entries = await self.daemon.ledger.entries(limit=10_000, kind=kind)
        return [(e, (await self.daemon.ledger.body(e.body)).value) for e in entries]


@pytest.fixture
async def real(tmp_path: Path) -> AsyncIterator[Real]:
    settings = Settings.from_env(
        state_dir=tmp_path / "state", runtime_dir=tmp_path / "run", checkpoint_interval_s=3600
    )
    daemon = Daemon(settings)
    await daemon.start()
    runner = web.AppRunner(create_app(daemon, HttpOptions(token=TOKEN)))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    base = f"http://127.0.0.1:{runner.addresses[0][1]}/v1"
    sdk = openai.AsyncOpenAI(base_url=base, api_key=TOKEN, max_retries=0, timeout=120)
    try:
        yield Real(daemon, sdk)
    finally:
        await sdk.close()
        await runner.cleanup()
        await daemon.stop()


QUESTION = [{"role": "user", "content": "Name one colour."}]


async def test_members_tiers_and_lanes_answer_streamed_and_not(real: Real) -> None:
    ids = [m.id async for m in real.sdk.models.list()]
    assert {"tiny", "tier:cheap", "lane:docs"} <= set(ids)
    for model in ("tiny", "tier:cheap", "lane:docs"):
        raw = await real.sdk.chat.completions.with_raw_response.create(
            model=model, messages=QUESTION, max_tokens=12
        )
        reply = raw.parse()
        assert reply.choices[0].message.content
        assert reply.usage.completion_tokens > 0
        seq = int(raw.headers["X-Tally-Seq"])
        entry = await real.daemon.ledger.get(seq)
        assert entry.kind == REPLY
        stream = await real.sdk.chat.completions.create(
            model=model,
            messages=QUESTION,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[-1].usage.completion_tokens > 0
        assert (chunks[-1].model_extra or {})["tally"]["seq"] > seq
    calls = await real.bodies(CALL)
    replies = await real.bodies(REPLY)
    assert len(calls) == len(replies) == 6
    assert all(body["client"] == "default" and body["member"] == "tiny" for _, body in calls)
    assert all(body["error"] is None and body["usage"]["completion_tokens"] for _, body in replies)
    lane_call = calls[4][1]
    assert lane_call["prepended"]


async def test_json_schema_output_parses(real: Real) -> None:
    schema = {
        "type": "object",
        "properties": {"colour": {"type": "string", "maxLength": 20}},
        "required": ["colour"],
        "additionalProperties": False,
    }
    reply = await real.sdk.chat.completions.create(
        model="tier:cheap",
        messages=QUESTION,
        max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
    )
    data = json.loads(reply.choices[0].message.content)
    assert isinstance(data["colour"], str)
    assert reply.usage.prompt_tokens > 0


async def test_a_killed_server_mid_stream_is_a_clean_error_then_recovers(real: Real) -> None:
    stream = await real.sdk.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Count from one to two hundred, in words."}],
        max_tokens=400,
        stream=True,
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            break
    [member] = [m for m in real.daemon.pool.status().members if m.name == "tiny"]
    pid = next(i.pid for i in member.instances if i.pid)
    os.kill(pid, signal.SIGKILL)

    async def drain() -> None:
        async for _ in stream:
            pass

    with pytest.raises(openai.APIError):
        await asyncio.wait_for(drain(), 60)
    reply = await real.sdk.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=8)
    assert reply.choices[0].message.content
    replies = [body for _, body in await real.bodies(REPLY)]
    assert replies[0]["error"]
    assert replies[-1]["error"] is None
