"""The MCP adapter speaks JSON-RPC as the spec says, over its real stdio: an unknown tool is
-32602, a line that is not JSON is -32700 and JSON that is not a message is -32600 (the SDK's
transport alone drops both silently), and arguments are validated as strictly as over HTTP.

Checked with the official SDK client and with raw lines written to the adapter's stdin."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import mcp_types as types
import pytest
from mcp.shared.exceptions import MCPError

from daemon.service import Daemon
from tests.interpreter import ROOT
from tests.surfaces.mcp_client import Stdio, session_for


async def test_unknown_tool_is_invalid_params(unix_server: Path) -> None:
    async with session_for(unix_server) as session:
        with pytest.raises(MCPError) as caught:
            await session.call_tool("no_such_tool", {})
        assert caught.value.code == types.INVALID_PARAMS == -32602
        assert "no_such_tool" in caught.value.message
        # The session is intact: the next call works.
        assert not (await session.call_tool("health", {})).is_error


@pytest.mark.parametrize(
    ("tool", "arguments"),
    [
        ("ledger_proof", {"kind": "inclusion", "seq": False}),  # bool is not int
        ("ledger_proof", {"kind": "inclusion"}),  # an inclusion proof needs seq
        ("ledger_entries", {"bodies": 0}),  # 0 is not false
        ("ledger_get", {"seq": "1"}),  # "1" is not 1
        ("ledger_get", {"seq": 2**80}),  # beyond what the ledger counts
        ("submit", {"request": "x", "budget": {"wall_s": 1e308}}),
        ("submit", {"request": "x", "timeout_s": -0.0}),
        (
            "submit",
            {
                "request": "x",
                "plan": {"tasks": [{"id": "T", "lane": "backend", "instruction": "i", "argv": []}]},
            },
        ),
    ],
)
async def test_arguments_are_strict(
    unix_server: Path, daemon: Daemon, tool: str, arguments: dict[str, Any]
) -> None:
    size = daemon.ledger.size
    async with session_for(unix_server) as session:
        result = await session.call_tool(tool, arguments)
    assert result.is_error, result.content
    text = result.content[0].text  # type: ignore[union-attr]
    # A plan failing its schema is refused by the daemon with every problem of it at once.
    assert "invalid arguments" in text or text.startswith("invalid_plan: tasks[0].argv")
    assert daemon.ledger.size == size  # refused before anything was witnessed


@asynccontextmanager
async def adapter(socket_path: Path) -> AsyncIterator[Stdio]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "surfaces",
        "mcp",
        cwd=str(ROOT),
        env={"TALLY_SOCKET": str(socket_path), "PATH": "/usr/bin:/bin"},
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    io = Stdio(proc)
    try:
        await io.request(
            0,
            "initialize",
            {
                "protocolVersion": "2025-11-25",
                "capabilities": {},
                "clientInfo": {"name": "raw", "version": "0"},
            },
        )
        assert "result" in await io.receive()
        await io.send(json.dumps({"jsonrpc": "2.0", "method": "notifications/initialized"}))
        yield io
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except TimeoutError:
            proc.kill()
            await proc.wait()


async def test_raw_lines_get_json_rpc_errors(unix_server: Path) -> None:
    async with adapter(unix_server) as io:
        await io.send("{not json")
        assert await io.receive() == {
            "jsonrpc": "2.0",
            "id": None,
            "error": {"code": -32700, "message": "Parse error"},
        }
        await io.send(b"\xff\xfe garbage")
        assert (await io.receive())["error"]["code"] == -32700
        await io.send(json.dumps({"hello": "world"}))  # JSON, but not a JSON-RPC message
        assert (await io.receive())["error"] == {"code": -32600, "message": "Invalid Request"}

        await io.request(1, "tools/call", {"name": "nope", "arguments": {}})
        unknown = await io.receive()
        assert unknown["id"] == 1
        assert unknown["error"]["code"] == -32602

        # NaN and Infinity are not JSON; where the SDK's parser lets them through, the
        # arguments' validation refuses them before anything reaches the daemon.
        for bad in ("NaN", "Infinity", "-Infinity", "1e400"):
            await io.send(
                '{"jsonrpc":"2.0","id":2,"method":"tools/call","params":{"name":"submit",'
                '"arguments":{"request":"x","budget":{"wall_s":' + bad + "}}}}"
            )
            answer = await io.receive()
            assert answer["id"] == 2
            refused = "error" in answer or answer["result"]["isError"] is True
            assert refused, (bad, answer)

        # And the session still works.
        await io.request(3, "tools/call", {"name": "health", "arguments": {}})
        health = await io.receive()
        assert health["id"] == 3
        assert health["result"]["isError"] is False
