"""A real Daemon (fake model server as the pool's only stand-in) served by the real HTTP app on
a unix socket (its owner is admin) and on a TCP port (browsers), as `tally serve --tcp` does."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from daemon.service import Daemon
from daemon.slots.process import free_port
from surfaces import console
from surfaces.http import HttpOptions, create_app
from tests.slots.fake_server import FakeServer
from tests.surfaces.conftest import daemon_settings

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Served:
    daemon: Daemon
    socket: Path
    url: str

    async def login_url(self, *flags: str) -> str:
        """`tally console` as a real process, asking the daemon over its socket."""
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "surfaces",
            "console",
            "--socket",
            str(self.socket),
            *flags,
            cwd=ROOT,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, err.decode()
        return out.decode().strip()

    async def session(self, *flags: str) -> str:
        """Log in as the login page does (POST the code from a fresh one-time URL's fragment,
        with the console's Origin); the session secret."""
        url = await self.login_url(*flags)
        code = url.split("#code=", 1)[1]
        async with (
            aiohttp.ClientSession() as http,
            http.post(
                f"{self.url}{console.LOGIN_PATH}", json={"code": code}, headers={"Origin": self.url}
            ) as resp,
        ):
            assert resp.status == 200, await resp.text()
            return str((await resp.json())["session"])


async def serve_both(daemon: Daemon, tmp_path: Path) -> AsyncIterator[Served]:
    path = tmp_path / "sock" / "tally.sock"
    path.parent.mkdir()
    app = create_app(daemon, HttpOptions(keepalive_s=0.5))
    runner = web.AppRunner(app)
    await runner.setup()
    await web.UnixSite(runner, str(path)).start()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    console.set_base(app, f"http://127.0.0.1:{port}")
    try:
        yield Served(daemon, path, f"http://127.0.0.1:{port}")
    finally:
        await runner.cleanup()


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
async def served(tmp_path: Path, model: FakeServer) -> AsyncIterator[Served]:
    daemon = Daemon(daemon_settings(tmp_path, model.url))
    await daemon.start()
    try:
        async for s in serve_both(daemon, tmp_path):
            yield s
    finally:
        await daemon.stop()
