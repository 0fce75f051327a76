"""The real third-party client: MCP Inspector CLI (npm, pinned in tests/e2e/package.json),
through the adapter to the real daemon (fixtures from tests/surfaces/conftest.py)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from daemon.service import Daemon
from daemon.tools import TOOLS

ROOT = Path(__file__).resolve().parents[2]
INSPECTOR = ROOT / "tests/e2e/node_modules/.bin/mcp-inspector"

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(not INSPECTOR.exists(), reason="run `make install` for the inspector"),
]


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


async def test_inspector_lists_tools_strict(unix_server: Path) -> None:
    code, out, err = await inspector(unix_server, "--method", "tools/list", "--strict")
    assert code == 0, err
    assert err.strip() == "", err  # no schema portability findings, not even warnings
    names = [t["name"] for t in json.loads(out)["tools"]]
    assert names == list(TOOLS)


async def test_inspector_calls_a_tool(unix_server: Path, daemon: Daemon) -> None:
    code, out, err = await inspector(
        unix_server,
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
    previews = await daemon.ledger.entries(kind="route.preview")
    assert len(previews) == 1  # the call reached the daemon and was witnessed
