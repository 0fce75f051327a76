"""`tally serve --tcp` as a real process, driven through its CLI and MCP adapter."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import aiohttp
import pytest

from daemon.slots.process import free_port
from tests.slots.fake_server import FakeServer
from tests.surfaces.conftest import roster_toml

ROOT = Path(__file__).resolve().parents[2]


class Tcp:
    def __init__(self, tmp_path: Path, model: FakeServer) -> None:
        self.state = tmp_path / "state"
        self.socket = tmp_path / "run" / "tally.sock"
        self.url = f"http://127.0.0.1:{free_port()}"
        roster = tmp_path / "roster.toml"
        roster.write_text(roster_toml(model.url))
        base = {k: v for k, v in os.environ.items() if not k.startswith("TALLY_")}
        self.env = base | {"TALLY_STATE_DIR": str(self.state), "TALLY_ROSTER": str(roster)}
        self.log = tmp_path / "serve.log"
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        self.socket.unlink(missing_ok=True)
        argv = ["serve", "--tcp", self.url.removeprefix("http://"), "--socket", str(self.socket)]
        with self.log.open("a") as log:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "surfaces", *argv, env=self.env, cwd=ROOT, stderr=log
            )
        for _ in range(300):
            if self.socket.exists() and await self._tcp_up():
                return
            assert self.proc.returncode is None, self.log.read_text()
            await asyncio.sleep(0.05)
        pytest.fail("the daemon did not listen within 15 s")

    async def _tcp_up(self) -> bool:
        """The TCP listener may start after the unix socket: /healthz needs no token."""
        try:
            async with aiohttp.ClientSession() as http, http.get(f"{self.url}/healthz") as resp:
                return resp.status == 200
        except aiohttp.ClientConnectionError:
            return False

    async def stop(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(self.proc.wait(), 30) == 0, self.log.read_text()

    async def tally(self, *args: str, token: str | None = None) -> tuple[int, str, str]:
        env = self.env | {"TALLY_URL": self.url}
        if token is not None:
            env["TALLY_TOKEN"] = token
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "surfaces",
            *args,
            env=env,
            cwd=ROOT,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode is not None
        return proc.returncode, out.decode(), err.decode()
