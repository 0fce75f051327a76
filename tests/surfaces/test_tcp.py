"""`tally serve --tcp` as a real process: the token file and `tally token`, bearer auth on a
real socket, the CLI and the MCP adapter reaching it through TALLY_URL + TALLY_TOKEN, and
`run`/`cancel`/`resume` across a daemon restart. The model server is the in-process fake."""

from __future__ import annotations

import asyncio
import json
import stat
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client

from tests.slots.fake_server import FakeServer
from tests.surfaces.conftest import two_tasks
from tests.surfaces.tcp import ROOT, Tcp


@pytest.fixture
async def tcp(tmp_path: Path, model: FakeServer) -> AsyncIterator[Tcp]:
    daemon = Tcp(tmp_path, model)
    await daemon.start()
    try:
        yield daemon
    finally:
        if daemon.proc is not None and daemon.proc.returncode is None:
            daemon.proc.kill()
            await daemon.proc.wait()


async def test_token_file_and_bearer_auth(tcp: Tcp) -> None:
    token_file = tcp.state / "http.token"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    code, out, _ = await tcp.tally("token", "--state", str(tcp.state))
    assert code == 0
    token = out.strip()
    assert token == token_file.read_text().strip()
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{tcp.url}/v1/tools") as resp:
            assert resp.status == 401
            assert "error" in await resp.json()
        headers = {"Authorization": f"Bearer {token}"}
        async with http.get(f"{tcp.url}/v1/tools", headers=headers) as resp:
            assert resp.status == 200
    code, _, err = await tcp.tally("runs", token="wrong")
    assert code == 1
    assert "Traceback" not in err


async def test_mcp_adapter_over_tcp_with_the_token(tcp: Tcp) -> None:
    token = (tcp.state / "http.token").read_text().strip()
    for given, ok in ((token, True), ("wrong", False)):
        params = StdioServerParameters(
            command=sys.executable,
            args=["-m", "surfaces", "mcp"],
            env={"TALLY_URL": tcp.url, "TALLY_TOKEN": given},
            cwd=str(ROOT),
        )
        async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
            await session.initialize()
            result = await session.call_tool("health", {})
            assert result.is_error is not ok, result.content


async def test_run_cancel_and_resume_from_the_cli(tcp: Tcp, model: FakeServer) -> None:
    token = (tcp.state / "http.token").read_text().strip()
    plan = tcp.state.parent / "plan.json"
    plan.write_text(json.dumps(two_tasks()))

    async def submit() -> str:
        code, out, err = await tcp.tally(
            "submit", "--detach", "--json", "--plan", str(plan), "the api", token=token
        )
        assert code == 0, err
        run_id: str = json.loads(out)["id"]
        return run_id

    async def show(run_id: str) -> dict[str, Any]:
        code, out, err = await tcp.tally("run", run_id, "--json", token=token)
        assert code == 0, err
        run: dict[str, Any] = json.loads(out)
        return run

    model.token_delay_s = 0.5  # slow enough to act while the run is in flight
    cancelled = await submit()
    code, out, err = await tcp.tally("cancel", cancelled, "--json", token=token)
    assert code == 0, err
    assert json.loads(out)["state"] == "cancelled"
    code, _, err = await tcp.tally("resume", cancelled, token=token)
    assert code == 1  # only an interrupted run resumes
    assert cancelled in err or "interrupted" in err

    interrupted = await submit()
    for _ in range(100):
        if (await show(interrupted))["state"] == "running":
            break
        await asyncio.sleep(0.1)
    await tcp.stop()  # the run outlasts the drain: it is interrupted, resumable
    await tcp.start()
    assert (await show(interrupted))["state"] == "interrupted"
    model.token_delay_s = 0
    code, out, err = await tcp.tally("resume", interrupted, "--json", token=token)
    assert code == 0, err
    for _ in range(200):
        if (run := await show(interrupted))["state"] == "done":
            break
        await asyncio.sleep(0.1)
    assert run["state"] == "done", run
    await tcp.stop()
