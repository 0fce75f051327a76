"""The MCP adapter as its clients run it: the SDK's client over stdio, or raw lines."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client

from tests.interpreter import ROOT


def params(socket_path: Path, env: dict[str, str] | None = None) -> StdioServerParameters:
    return StdioServerParameters(
        command=sys.executable,
        args=["-m", "surfaces", "mcp"],
        env={"TALLY_SOCKET": str(socket_path)} | (env or {}),
        cwd=str(ROOT),
    )


@asynccontextmanager
async def session_for(
    socket_path: Path, env: dict[str, str] | None = None
) -> AsyncIterator[ClientSession]:
    # Inline in each test, not a fixture: anyio scopes must exit in the task that entered them.
    async with (
        stdio_client(params(socket_path, env)) as (read, write),
        ClientSession(read, write) as session,
    ):
        await session.initialize()
        yield session


class Stdio:
    """The adapter as a subprocess, driven line by line."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    async def send(self, line: str | bytes) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.encode() if isinstance(line, str) else line)
        self.proc.stdin.write(b"\n")
        await self.proc.stdin.drain()

    async def request(self, id_: int, method: str, params: dict[str, Any]) -> None:
        await self.send(
            json.dumps({"jsonrpc": "2.0", "id": id_, "method": method, "params": params})
        )

    async def receive(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        while True:
            line = await asyncio.wait_for(self.proc.stdout.readline(), 20)
            assert line, "the adapter closed its stdout"
            message: dict[str, Any] = json.loads(line)
            if "id" in message:  # skip notifications (logging, progress)
                return message
