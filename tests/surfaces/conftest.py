"""Fixtures: the real Daemon (ledger in tmp_path, engine, slot pool) whose pool members are a
fake OpenAI-compatible model server (the only stand-in), served by the real HTTP app over TCP
(with the token) or a unix socket."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from daemon.config import Settings
from daemon.service import Daemon
from surfaces.http import HttpOptions, create_app
from tests.runs.model_server import roster_toml as shared_roster_toml
from tests.runs.model_server import settings_for
from tests.slots.fake_server import FakeServer

TOKEN = "test-token-123"

# Two lanes the router can tell apart; both tiers point at the same external fake server.
LANES = """
[[lanes]]
name = "backend"
keywords = ["api", "server", "endpoint", "database"]
tier = "cheap"
system = "You write backend code."

[[lanes]]
name = "docs"
keywords = ["readme", "docs", "documentation"]
tier = "cheap"
system = "You write documentation."
"""


def roster_toml(url: str) -> str:
    return shared_roster_toml(url, lanes=LANES)


def two_tasks(request: str = "build the api") -> dict[str, Any]:
    """A plan whose run ends with a streamed synthesis call (so SSE carries `delta`s)."""
    return {
        "tasks": [
            {"id": "T1", "lane": "backend", "instruction": f"{request}: part one"},
            {"id": "T2", "lane": "backend", "instruction": f"{request}: part two", "needs": ["T1"]},
        ]
    }


def daemon_settings(tmp_path: Path, url: str) -> Settings:
    return settings_for(tmp_path, roster_toml(url))


@pytest.fixture
async def model() -> AsyncIterator[FakeServer]:
    server = FakeServer(slots=4, n_ctx=4096)
    await server.start()
    try:
        yield server
    finally:
        server.token_delay_s = 0
        await server.stop()


@pytest.fixture
async def daemon(tmp_path: Path, model: FakeServer) -> AsyncIterator[Daemon]:
    d = Daemon(daemon_settings(tmp_path, model.url))
    await d.start()
    try:
        yield d
    finally:
        await d.stop()


@pytest.fixture
async def client(daemon: Daemon) -> AsyncIterator[TestClient[Any, Any]]:
    app = create_app(daemon, HttpOptions(token=TOKEN, body_limit=64 * 1024, keepalive_s=0.2))
    async with TestClient(TestServer(app), headers={"Authorization": f"Bearer {TOKEN}"}) as c:
        yield c


@pytest.fixture
async def unix_server(daemon: Daemon, tmp_path: Path) -> AsyncIterator[Path]:
    """The app served on a unix socket, as `tally serve` does by default."""
    path = tmp_path / "sock" / "tally.sock"
    path.parent.mkdir()
    runner = web.AppRunner(create_app(daemon, HttpOptions(keepalive_s=0.2)))
    await runner.setup()
    await web.UnixSite(runner, str(path)).start()
    path.chmod(0o600)
    try:
        yield path
    finally:
        await runner.cleanup()


@pytest.fixture
async def unix_session(unix_server: Path) -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(unix_server))) as s:
        yield s
