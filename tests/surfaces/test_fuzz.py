"""Property-based fuzzing of every tool's HTTP input against the real daemon: whatever the
body, never a 5xx, and the ledger still verifies (deep) after each tool's examples."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from daemon.service import Daemon
from daemon.tools import TOOLS
from surfaces.http import HttpOptions, create_app
from tests.slots.fake_server import FakeServer
from tests.surfaces.conftest import daemon_settings

TOKEN = "fuzz"

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**63), max_value=2**63),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=40),
    st.sampled_from(["", "inclusion", "consistency", "done", "r1", "a" * 64, "backend"]),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


# One valid call per tool that changes state, so the fuzzing runs among real runs and entries.
VALID: dict[str, Any] = {
    "submit": {"request": "fuzz the api", "wait": True, "timeout_s": 20},
    "route": {"text": "the api server"},
    "ledger_checkpoint": {"create": True},
    "ledger_summary": {},
}


def bodies(tool: str) -> st.SearchStrategy[Any]:
    props = list(TOOLS[tool].input.model_json_schema().get("properties", {}))
    keys = st.sampled_from(props) if props else st.text(max_size=8)
    return st.one_of(
        st.dictionaries(keys, values, max_size=len(props) + 1),
        st.dictionaries(st.one_of(keys, st.text(max_size=8)), values, max_size=3),
        values,
    )


@pytest.fixture(scope="module")
def port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """The app over the real daemon on its own loop in a thread (hypothesis drives it sync)."""
    tmp: Path = tmp_path_factory.mktemp("fuzz")
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    holder: dict[str, Any] = {}

    async def start() -> None:
        model = FakeServer(slots=4)
        await model.start()
        daemon = Daemon(daemon_settings(tmp, model.url))
        await daemon.start()
        runner = web.AppRunner(create_app(daemon, HttpOptions(token=TOKEN)))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        holder.update(runner=runner, port=runner.addresses[0][1], daemon=daemon, model=model)

    async def stop() -> None:
        await holder["runner"].cleanup()
        await holder["daemon"].stop()
        await holder["model"].stop()

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(start())
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    ready.wait(10)
    yield holder["port"]
    asyncio.run_coroutine_threadsafe(stop(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def post(port: int, path: str, body: bytes) -> int:
    return exchange(port, path, body)[0]


def exchange(port: int, path: str, body: bytes) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(
            "POST",
            path,
            body=body,
            headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
        )
        resp = conn.getresponse()
        data = resp.read()
        assert resp.status < 500, (path, body[:300], resp.status, data[:300])
        if resp.status != 200:
            assert set(json.loads(data)) == {"error"}
        return resp.status, json.loads(data)
    finally:
        conn.close()


@pytest.mark.parametrize("tool", list(TOOLS))
def test_tool_input_fuzz_never_5xx(port: int, tool: str) -> None:

    @settings(
        max_examples=25,
        deadline=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )
    @given(body=bodies(tool))
    def check(body: Any) -> None:
        post(port, f"/v1/tools/{tool}", json.dumps(body).encode())

    if tool in VALID:
        check = example(body=VALID[tool])(check)
    check()
    status, report = exchange(port, "/v1/tools/ledger_verify", b'{"deep": true}')
    assert status == 200
    assert report["ok"], report


@given(raw=st.binary(max_size=200))
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_garbage_bodies_are_4xx(port: int, raw: bytes) -> None:
    assert 400 <= post(port, "/v1/tools/route", raw) < 500 or raw.strip().startswith(b"{")
