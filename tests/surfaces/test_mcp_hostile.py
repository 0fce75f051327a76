"""The MCP adapter over its real stdio survives hostile JSON-RPC and answers the next request.

Huge ids, 100k-deep params, a 10 MiB line, a flood of requests, and notifications (cancels,
progress, unknown methods) for requests that do not exist: after each, a valid `tools/call`
still gets its answer.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from tests.interpreter import ROOT
from tests.surfaces.mcp_client import Stdio


@asynccontextmanager
async def adapter(socket_path: Path) -> AsyncIterator[Stdio]:
    """`tally mcp` as a subprocess (as in test_mcp_protocol), read with room for the 1 MiB
    answer a 1 MiB id gets, and killed if it has not ended 10 s after its stdin closed."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "surfaces", "mcp",
        cwd=str(ROOT),
        env={"TALLY_SOCKET": str(socket_path), "PATH": "/usr/bin:/bin"},
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
        limit=16 << 20,
    )  # fmt: skip
    io = Stdio(proc)
    try:
        info = {"name": "raw", "version": "0"}
        await io.request(
            0,
            "initialize",
            {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": info},
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


async def _still_answers(io: Stdio, id_: int) -> None:
    await io.request(id_, "tools/call", {"name": "health", "arguments": {}})
    answer = await io.receive()
    while answer.get("id") != id_:  # answers to earlier hostile lines may come first
        answer = await io.receive()
    assert answer["result"]["isError"] is False, answer


def _raw(id_: Any, method: str, params: Any) -> str:
    return json.dumps({"jsonrpc": "2.0", "id": id_, "method": method, "params": params})


async def test_huge_ids_deep_params_and_long_lines(unix_server: Path) -> None:
    async with asyncio.timeout(60), adapter(unix_server) as io:
        await io.send('{"jsonrpc":"2.0","id":' + "9" * 5000 + ',"method":"ping"}')
        await _still_answers(io, 1)
        await io.send(_raw("x" * (1 << 20), "ping", {}))
        await _still_answers(io, 2)
        deep = '{"a":' * 100_000 + "1" + "}" * 100_000
        await io.send(
            '{"jsonrpc":"2.0","id":3,"method":"tools/call","params":{"name":"health",'
            '"arguments":' + deep + "}}"
        )
        await io.send('{"jsonrpc":"2.0","id":4,"method":"ping","params":' + "[" * 100_000)
        await _still_answers(io, 5)
        await io.send(
            _raw(6, "tools/call", {"name": "route", "arguments": {"request": "x" * (10 << 20)}})
        )
        await _still_answers(io, 7)
        assert io.proc.returncode is None


async def test_a_flood_and_notifications_for_unknown_requests(unix_server: Path) -> None:
    async with asyncio.timeout(60), adapter(unix_server) as io:
        for n in range(100):
            for method, params in (
                ("notifications/cancelled", {"requestId": 10_000 + n, "reason": "no such"}),
                ("notifications/cancelled", {"requestId": "ghost"}),
                ("notifications/progress", {"progressToken": n, "progress": 1}),
                ("notifications/no_such_thing", {"x": n}),
                ("notifications/cancelled", {"requestId": None}),
            ):
                await io.send(json.dumps({"jsonrpc": "2.0", "method": method, "params": params}))
        await _still_answers(io, 1)
        started = time.monotonic()
        assert io.proc.stdin is not None
        for n in range(1000):
            io.proc.stdin.write((_raw(100 + n, "ping", {}) + "\n").encode())
        await io.proc.stdin.drain()
        seen = 0
        while seen < 1000:
            answer = await io.receive()
            seen += 1 if isinstance(answer.get("id"), int) and answer["id"] >= 100 else 0
        await _still_answers(io, 2)
        assert time.monotonic() - started < 30
        # a cancel for a request that already finished is ignored too
        await io.send(json.dumps({"jsonrpc": "2.0", "method": "notifications/cancelled",
                                  "params": {"requestId": 2}}))  # fmt: skip
        await _still_answers(io, 3)
        await asyncio.sleep(0)
        assert io.proc.returncode is None
