"""Fixtures: the HTTP app over a fake daemon, reached over TCP (with the token) or a socket."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from surfaces.http import HttpOptions, create_app
from tests.surfaces.fake import FakeDaemon

TOKEN = "test-token-123"


@pytest.fixture
def fake() -> FakeDaemon:
    return FakeDaemon()


@pytest.fixture
async def client(fake: FakeDaemon) -> AsyncIterator[TestClient[Any, Any]]:
    app = create_app(fake, HttpOptions(token=TOKEN, body_limit=64 * 1024, keepalive_s=0.2))  # type: ignore[arg-type]
    async with TestClient(TestServer(app), headers={"Authorization": f"Bearer {TOKEN}"}) as c:
        yield c


@pytest.fixture
async def unix_server(fake: FakeDaemon, tmp_path: Path) -> AsyncIterator[Path]:
    """The app served on a unix socket, as `tally serve` does by default."""
    path = tmp_path / "run" / "tally.sock"
    path.parent.mkdir()
    runner = web.AppRunner(create_app(fake, HttpOptions(keepalive_s=0.2)))  # type: ignore[arg-type]
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
