"""The real third-party client: MCP Inspector CLI (npm, pinned in tests/e2e/package.json)."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

from daemon.tools import TOOLS
from surfaces.http import HttpOptions, create_app
from tests.surfaces.fake import FakeDaemon

ROOT = Path(__file__).resolve().parents[2]
INSPECTOR = ROOT / "tests/e2e/node_modules/.bin/mcp-inspector"

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not INSPECTOR.exists(), reason="run `make install` for the inspector"),
]


@pytest.fixture
async def daemon_socket(tmp_path: Path) -> AsyncIterator[Path]:
    path = tmp_path / "tally.sock"
    runner = web.AppRunner(create_app(FakeDaemon(), HttpOptions()))  # type: ignore[arg-type]
    await runner.setup()
    await web.UnixSite(runner, str(path)).start()
    try:
        yield path
    finally:
        await runner.cleanup()


async def inspector(socket_path: Path, *args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        str(INSPECTOR),
        "--cli",
        "-e",
        f"TALLY_SOCKET={socket_path}",
        "--cwd",
        str(ROOT),
        sys.executable,
        "-m",
        "surfaces",
        "mcp",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_inspector_lists_tools_strict(daemon_socket: Path) -> None:
    code, out, err = await inspector(daemon_socket, "--method", "tools/list", "--strict")
    assert code == 0, err
    names = [t["name"] for t in json.loads(out)["tools"]]
    assert names == list(TOOLS)


async def test_inspector_calls_a_tool(daemon_socket: Path) -> None:
    code, out, err = await inspector(
        daemon_socket,
        "--method",
        "tools/call",
        "--tool-name",
        "route",
        "--tool-arg",
        "text=the api server returns 500",
    )
    assert code == 0, err
    result = json.loads(out)
    assert result["isError"] is False
    assert result["structuredContent"]["lane"] == "backend"
