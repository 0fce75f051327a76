"""MCP adapter end to end over stdio with the SDK's client, against the real daemon's HTTP app."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal
import sys
from pathlib import Path
from typing import Any

import aiohttp
import anyio
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client

from daemon.runs import entries as k
from daemon.service import Daemon
from daemon.tools import TOOLS
from surfaces.units import user_unit
from tests.polling import TIMEOUT_S, until
from tests.slots.fake_server import FakeServer
from tests.surfaces.conftest import roster_toml, two_tasks
from tests.surfaces.mcp_client import Stdio, session_for

ROOT = Path(__file__).resolve().parents[2]


async def test_tools_list_parity_with_http(
    unix_server: Path, unix_session: aiohttp.ClientSession
) -> None:
    async with session_for(unix_server) as mcp_session:
        listed = (await mcp_session.list_tools()).tools
    async with unix_session.get("http://tally/v1/tools") as resp:
        http_tools = (await resp.json())["tools"]
    assert [t.name for t in listed] == [t["name"] for t in http_tools] == list(TOOLS)
    for mcp_tool, http_tool in zip(listed, http_tools, strict=True):
        assert mcp_tool.input_schema == http_tool["input_schema"]
        assert mcp_tool.output_schema == http_tool["output_schema"]
        assert mcp_tool.description == http_tool["description"]


async def test_call_progress_and_errors(unix_server: Path, daemon: Daemon) -> None:
    async with session_for(unix_server) as mcp_session:
        await _call_progress_and_errors(mcp_session, daemon)


async def _call_progress_and_errors(mcp_session: ClientSession, daemon: Daemon) -> None:
    routed = await mcp_session.call_tool("route", {"text": "the api server is down"})
    assert not routed.is_error
    assert routed.structured_content is not None
    assert routed.structured_content["lane"] == "backend"

    seen: list[tuple[float, float | None, str | None]] = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        seen.append((progress, total, message))

    args: dict[str, Any] = {"request": "fix the api", "plan": two_tasks(), "wait": True}
    result = await mcp_session.call_tool("submit", args, progress_callback=on_progress)
    assert not result.is_error, result.content
    run = result.structured_content
    assert run is not None
    assert run["state"] == "done"
    assert run["answer"] == daemon.engine.get(run["id"]).answer
    assert run["answer"].startswith("t0 ")
    assert len(seen) >= 3
    assert seen[-1][2] == "done: 2/2 tasks done"
    # MCP: every notification's progress is greater than the one before
    assert all(a[0] < b[0] for a, b in itertools.pairwise(seen)), seen
    assert len({p[2] for p in seen}) == len(seen), seen  # and each says something new
    # streamed tokens arrive as progress messages naming the task that writes them
    assert any((p[2] or "").startswith("T1 writing: …t0") for p in seen), seen

    summary = await mcp_session.call_tool("ledger_summary", {"run": run["id"]})
    assert summary.structured_content is not None
    assert summary.structured_content["model_calls"] == 3

    bad = await mcp_session.call_tool("route", {"text": ""})
    assert bad.is_error
    missing = await mcp_session.call_tool("run_get", {"run_id": "nope"})
    assert missing.is_error
    assert "not_found" in missing.content[0].text  # type: ignore[union-attr]


async def test_cancellation_reaches_the_run(
    unix_server: Path, daemon: Daemon, model: FakeServer
) -> None:
    model.token_delay_s = 0.05  # 512 tokens per call: the run would take a minute
    async with (
        session_for(unix_server, {"TALLY_LOG": "INFO"}) as mcp_session,
        anyio.create_task_group() as tg,
    ):

        async def submit() -> None:
            await mcp_session.call_tool("submit", {"request": "slow api", "wait": True})
            raise AssertionError("the slow run ended before the call was cancelled")

        tg.start_soon(submit)
        # Cancel once the run is mid model call (not after a fixed time, which on a loaded
        # machine may pass before the adapter even forwarded the submit).
        await until(
            lambda: daemon.engine.list() and model.processing,
            what="the submitted run streaming from the model",
        )
        tg.cancel_scope.cancel()
    (run,) = daemon.engine.list()
    await until(
        lambda: daemon.engine.get(run.id).state == "cancelled",
        what=lambda: f"run cancelled (it is {daemon.engine.get(run.id).state})",
    )
    record = await daemon.ledger.entries(run=run.id, limit=1000)
    assert k.CANCEL in [e.kind for e in record], [e.kind for e in record]
    assert record[-1].kind == k.STATE, record[-1]
    assert (await daemon.ledger.body(record[-1].body)).value["state"] == "cancelled"
    assert (await daemon.ledger.verify()).ok


async def test_sigterm_mid_submit_cancels_the_run(
    unix_server: Path, daemon: Daemon, model: FakeServer
) -> None:
    """An SDK client closing a session SIGTERMs the adapter 2 s after stdin closed: the
    adapter ends the session as on EOF, so the run it followed is cancelled, not orphaned."""
    model.token_delay_s = 0.05  # 512 tokens per call: the run would take a minute
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "surfaces", "mcp",
        cwd=str(ROOT),
        env={"TALLY_SOCKET": str(unix_server), "PATH": "/usr/bin:/bin"},
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    io = Stdio(proc)
    try:
        info = {"name": "raw", "version": "0"}
        await io.request(
            0,
            "initialize",
            {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": info},
        )
        assert "result" in await io.receive(), "initialize not answered"
        await io.send('{"jsonrpc": "2.0", "method": "notifications/initialized"}')
        call = {"name": "submit", "arguments": {"request": "slow api", "wait": True}}
        await io.request(1, "tools/call", call)
        await until(
            lambda: daemon.engine.list() and model.processing,
            what="the submitted run streaming from the model",
        )
        proc.send_signal(signal.SIGTERM)
        (run,) = daemon.engine.list()
        await until(
            lambda: daemon.engine.get(run.id).state == "cancelled",
            what=lambda: f"run cancelled (it is {daemon.engine.get(run.id).state})",
        )
        code = await asyncio.wait_for(proc.wait(), TIMEOUT_S)
        assert code == -signal.SIGTERM, f"the adapter ended with {code} on SIGTERM"
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def _system_unit_here() -> bool:
    units = ("/etc/systemd/system", "/lib/systemd/system")
    return any(Path(d, "tallyd.service").exists() for d in units)


async def test_daemon_down_every_call_says_how_to_start(tmp_path: Path) -> None:
    # A user unit installed (in this XDG_CONFIG_HOME): the hint names it.
    config = tmp_path / "config"
    (config / "systemd" / "user").mkdir(parents=True)
    (config / "systemd" / "user" / "tallyd.service").write_text(user_unit())
    async with session_for(tmp_path / "nothing.sock", {"XDG_CONFIG_HOME": str(config)}) as session:
        tools = (await session.list_tools()).tools
        assert len(tools) == len(TOOLS)
        for name, args in (("health", {}), ("route", {"text": "x"})):
            result = await session.call_tool(name, args)
            assert result.is_error
            text: Any = result.content[0]
            assert "tally daemon is not running" in text.text
            assert "systemctl --user start tallyd" in text.text
            assert "tally serve" in text.text
            assert str(tmp_path / "nothing.sock") in text.text
            assert "TALLY_SOCKET" in text.text
    # No unit installed (an empty XDG_CONFIG_HOME, no system unit here): `tally serve` alone.
    empty = {"XDG_CONFIG_HOME": str(tmp_path / "empty")}
    if _system_unit_here():
        return  # this machine has a system unit: the hint rightly names it
    async with session_for(tmp_path / "nothing.sock", empty) as session:
        result = await session.call_tool("health", {})
        text = result.content[0]
        assert "tally serve" in text.text
        assert "systemctl" not in text.text


async def test_autostart_starts_a_daemon_where_the_adapter_looks(
    tmp_path: Path, model: FakeServer
) -> None:
    """`tally mcp --autostart` with TALLY_SOCKET set: the daemon it starts listens there."""
    sock = tmp_path / "elsewhere" / "tally.sock"
    roster = tmp_path / "roster.toml"
    roster.write_text(roster_toml(model.url))
    state = tmp_path / "state"
    server = StdioServerParameters(
        command=sys.executable,
        args=["-m", "surfaces", "mcp", "--autostart"],
        env={"TALLY_SOCKET": str(sock), "TALLY_STATE_DIR": str(state), "TALLY_ROSTER": str(roster)},
        cwd=str(ROOT),
    )
    try:
        async with (
            stdio_client(server) as (read, write),
            ClientSession(read, write) as session,
        ):
            await session.initialize()
            result = await session.call_tool("health", {})
            assert not result.is_error, result.content
            assert result.structured_content is not None
            assert result.structured_content["lanes"] == 2
        assert sock.exists()
    finally:
        lock = state / "ledger" / "lock"
        pid = int(lock.read_text()) if lock.exists() and lock.read_text().strip() else None
        if pid is not None:
            os.kill(pid, signal.SIGTERM)
            for _ in range(100):
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
                await asyncio.sleep(0.05)
