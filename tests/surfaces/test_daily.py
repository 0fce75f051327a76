"""Daily use against a real daemon (`tally serve` in a subprocess, the CLI as a user runs it):
runs waiting for a slot show `queued`/`waiting` (CLI, SSE, MCP); `status`, `logs`, `stop`;
`runs` and `run ID` read the record once the daemon is down; `| head` ends quietly.

The one stand-in is the model server: the in-process fake (two slots), whose token delay the
test turns down to let the runs finish.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client

from surfaces.client import DaemonClient, Endpoint
from tests.interpreter import tally_env
from tests.polling import until
from tests.slots.fake_server import FakeServer

ROOT = Path(__file__).resolve().parents[2]

ROSTER = """version = 1
[policy]
max_runs = 8

[[models]]
name = "tiny"
url = "{url}"
slots = 2

[tiers]
ladder = ["cheap"]
cheap = ["tiny"]

[[lanes]]
name = "backend"
keywords = ["api"]
tier = "cheap"
system = "You write backend code."

[[lanes]]
name = "docs"
keywords = ["readme"]
tier = "cheap"
system = "You write docs."
"""


async def tally(
    tmp_path: Path, *args: str, timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "surfaces", *args],
        env=tally_env(tmp_path),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.fixture
async def slow_model() -> AsyncIterator[FakeServer]:
    server = FakeServer(slots=2, n_ctx=4096, token_delay_s=0.05)
    await server.start()
    try:
        yield server
    finally:
        server.token_delay_s = 0
        await server.stop()


def _exited(pid: int) -> bool:
    """Exited: no such process, or a zombie its parent (this test) has not reaped yet."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rpartition(")")[2].split()[0] == "Z"


async def test_a_day_with_the_daemon(tmp_path: Path, slow_model: FakeServer) -> None:
    roster = tmp_path / "roster.toml"
    roster.write_text(ROSTER.format(url=slow_model.url))
    sock = tmp_path / "run" / "tally.sock"
    daemon = await asyncio.to_thread(
        subprocess.Popen,
        [sys.executable, "-m", "surfaces", "serve", "--roster", str(roster)],
        env=tally_env(tmp_path),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        await _day(tmp_path, slow_model, sock, daemon)
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()
        if daemon.stderr is not None:
            daemon.stderr.close()


async def _day(
    tmp_path: Path, model: FakeServer, sock: Path, daemon: subprocess.Popen[bytes]
) -> None:
    async with DaemonClient(Endpoint(socket_path=sock), timeout=10) as client:
        await until(client.ping, what="the daemon to listen")
        # 5 runs, 2 slots: 2 run, 3 wait for a slot and say so.
        ids = [(await client.call("submit", {"request": f"api work {i}"}))["id"] for i in range(5)]

        seen: list[Any] = []

        async def split() -> dict[str, list[dict[str, Any]]] | None:
            # The state the checks below are about, whole: a run turns "running" when its plan
            # is recorded, a moment before its task starts and leases a slot, so the run
            # states alone are not it. Both slots streaming a task is.
            runs = (await client.call("runs_list", {}))["runs"]
            by: dict[str, list[dict[str, Any]]] = {}
            for run in runs:
                by.setdefault(run["state"], []).append(run)
            seen[:] = [(r["state"], [t["state"] for t in r["tasks"]]) for r in runs]
            running, queued = by.get("running", []), by.get("queued", [])
            ok = (
                len(running) == 2
                and len(queued) == 3
                and all(t["state"] == "running" for r in running for t in r["tasks"])
                and all(t["state"] == "waiting" for r in queued for t in r["tasks"])
                and model.processing == {0, 1}
            )
            return by if ok else None

        by = await until(split, what=lambda: f"2 runs streaming and 3 queued; runs: {seen}")
        # Held there while the other clients look (each a new Python process, slow under
        # load): at 0.05 s a token the two running calls could end meanwhile.
        model.token_delay_s = 0.5
        assert {r["id"] for r in by["running"] + by["queued"]} == set(ids), (by, ids)
        only = (await client.call("runs_list", {"state": "queued"}))["runs"]
        assert {r["id"] for r in only} == {r["id"] for r in by["queued"]}, (only, by)
        queued = by["queued"][0]["id"]
        got = await client.call("run_get", {"run_id": queued})
        assert got["state"] == "queued", got

        # The CLI and `status` (another process, the real client) read the same.
        listed = await tally(tmp_path, "runs")
        assert listed.returncode == 0, listed.stderr
        assert listed.stdout.count(" queued ") == 3, listed.stdout
        assert listed.stdout.count(" running ") == 2, listed.stdout
        status = await tally(tmp_path, "status", "--json")
        assert status.returncode == 0, status.stderr
        body = json.loads(status.stdout)
        assert body["daemon"]["pid"] == daemon.pid, body["daemon"]
        assert body["daemon"]["listeners"] == [f"unix:{sock}"], body["daemon"]
        assert body["runs"]["by_state"] == {"running": 2, "queued": 3}, body["runs"]
        assert body["runs"]["tasks_by_state"] == {"running": 2, "waiting": 3}, body["runs"]
        assert body["pool"]["busy"] == 2, body["pool"]
        assert body["pool"]["queue"] == 3, body["pool"]
        assert body["ledger"]["writable"], body["ledger"]
        assert body["ledger"]["size"] > 0, body["ledger"]
        assert body["ledger"]["bytes"] > 0, body["ledger"]  # the record's own file
        text = (await tally(tmp_path, "status")).stdout
        assert f"pid {daemon.pid}" in text, text
        assert "queued 3" in text, text
        assert "waiting 3" in text, text
        assert "slots 2/2 busy" in text, text

        # MCP (the official SDK client through the adapter) reads the same state.
        server = StdioServerParameters(
            command=sys.executable,
            args=["-m", "surfaces", "mcp"],
            env={"TALLY_SOCKET": str(sock), "PYTHONPATH": str(ROOT)},
            cwd=str(ROOT),
        )
        async with (
            stdio_client(server) as (read, write),
            ClientSession(read, write) as session,
        ):
            await session.initialize()
            result = await session.call_tool("run_get", {"run_id": queued})
            assert not result.is_error, result.content
            assert result.structured_content is not None, result.content
            assert result.structured_content["state"] == "queued", result.structured_content

        # SSE: a queued run's stream says it waits, then that it stopped waiting.
        events: list[Any] = []

        async def watch() -> None:
            async for event in client.events(queued):
                events.append(event)

        watching = asyncio.create_task(watch())
        await until(
            lambda: any(e.event == "waiting" and e.data["waiting"] for e in events),
            what=lambda: f"a waiting event in {[e.event for e in events]}",
        )
        model.token_delay_s = 0  # let them all finish
        for run_id in ids:
            # 5 runs of 512 tokens through 2 slots: a bound on a hang, not a claim on speed
            await until(partial(_done, client, run_id), 60, what=f"run {run_id} done")
        await asyncio.wait_for(watching, 20)
        waits = [e.data["waiting"] for e in events if e.event == "waiting"]
        assert waits[0] is True, waits
        assert waits[-1] is False, waits

        # `logs --follow` sees the stop's own line; `logs` prints the daemon's log.
        follower = await asyncio.create_subprocess_exec(
            *[sys.executable, "-m", "surfaces", "logs", "--follow", "-n", "1"],
            env=tally_env(tmp_path),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        assert follower.stdout is not None, "no pipe from the follower"
        # it has looked at the files once: it printed the log's last line
        followed = (await asyncio.wait_for(follower.stdout.readline(), 30)).decode()
        assert followed.startswith("daemon | "), followed
        stop = await tally(tmp_path, "stop", timeout=60)
        assert stop.returncode == 0, stop.stderr
        assert "stopped" in stop.stderr, stop.stderr
        assert "tally: stopping: no run in flight" in stop.stderr, stop.stderr
        # "stopped" means the process is gone (exited), not only that its listener closed.
        assert _exited(daemon.pid), "tally stop said stopped while the daemon still ran"
        code = await asyncio.to_thread(daemon.wait, 10)
        assert code == 0, code
        while "stopping" not in followed:  # a poll of the follower prints the stop's line
            line = (await asyncio.wait_for(follower.stdout.readline(), 30)).decode()
            assert line, followed
            followed += line
        follower.terminate()
        await asyncio.wait_for(follower.wait(), 10)
        stopping = next(line for line in followed.splitlines() if "stopping" in line)
        assert stopping.startswith("daemon | "), followed
    logs = await tally(tmp_path, "logs", "-n", "200")
    assert logs.returncode == 0, logs.stderr
    assert "daemon | " in logs.stdout, logs.stdout
    assert "stopping: no run in flight" in logs.stdout, logs.stdout
    missing = await tally(
        tmp_path, "logs", "--member", "tiny"
    )  # external: tally keeps no log of it
    assert missing.returncode == 1, missing
    assert "no log of member 'tiny'" in missing.stderr, missing.stderr
    bad = await tally(tmp_path, "logs", "--member", "../x")
    assert bad.returncode == 2, bad
    again = await tally(tmp_path, "stop")
    assert again.returncode == 0, again  # nothing to stop: said, not an error

    # The daemon is down: runs and run ID read the record, say so, and change nothing.
    entries = tmp_path / "state" / "ledger"
    before = {p.name: p.read_bytes() for p in entries.iterdir() if p.is_file()}
    offline = await tally(tmp_path, "runs")
    assert offline.returncode == 0, offline.stderr
    assert "daemon is not running" in offline.stderr, offline.stderr
    assert "from the record" in offline.stderr, offline.stderr
    # no unit installed: the hint does not name one
    assert "systemctl" not in offline.stderr, offline.stderr
    rows = [line for line in offline.stdout.splitlines()[1:] if line.strip()]
    assert sorted(line.split()[0] for line in rows) == sorted(ids), (rows, ids)
    assert all(line.split()[1] == "done" for line in rows), rows
    assert all(line.split()[2].count("-") == 2 for line in rows), rows  # a date, not µs
    one = await tally(tmp_path, "run", ids[0], "--json")
    assert one.returncode == 0, one.stderr
    run = json.loads(one.stdout)
    assert run["id"] == ids[0], run
    assert run["state"] == "done", run
    assert run["answer"], run
    assert run["tasks"][0]["result"], run  # in full, not a summary
    text = (await tally(tmp_path, "run", ids[0])).stdout
    assert run["answer"] in text, text
    unknown = await tally(tmp_path, "run", "r0000000000000000")
    assert unknown.returncode == 1, unknown
    assert "no run r0000000000000000" in unknown.stderr, unknown.stderr
    after = {p.name: p.read_bytes() for p in entries.iterdir() if p.is_file()}
    assert after == before, "a read-only command changed the record's files"

    # `| head`: the reader leaves, tally ends quietly (no "Broken pipe", no traceback).
    piped = await asyncio.to_thread(
        subprocess.run,
        f"{sys.executable} -m surfaces ledger show --limit 100000 | head -1",
        shell=True,
        env=tally_env(tmp_path),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert piped.stdout.strip(), piped.stderr
    assert piped.stderr == "", piped.stderr


async def _done(client: DaemonClient, run_id: str) -> bool:
    return bool((await client.call("run_get", {"run_id": run_id}))["state"] == "done")


async def test_stop_with_runs_in_flight_waits_for_the_drain(
    tmp_path: Path, slow_model: FakeServer
) -> None:
    """`tally stop` while runs are in flight: it returns once the process is gone (through a
    drain in which the listener may take a connection and not answer), and `tally runs` then
    reads them from the record, interrupted."""
    roster = tmp_path / "roster.toml"
    roster.write_text(ROSTER.format(url=slow_model.url))
    slow_model.token_delay_s = 1.0  # the drain (5 s) outlasts none of them
    sock = tmp_path / "run" / "tally.sock"
    daemon = await asyncio.to_thread(
        subprocess.Popen,
        [sys.executable, "-m", "surfaces", "serve", "--roster", str(roster)],
        env=tally_env(tmp_path),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        async with DaemonClient(Endpoint(socket_path=sock), timeout=10) as client:
            await until(client.ping, what="the daemon to listen")
            # Before its first call an external member is "unused", not "stopped".
            before = await tally(tmp_path, "status")
            assert before.returncode == 0, before.stderr
            tiny = next(line for line in before.stdout.splitlines() if "tiny" in line)
            assert tiny.split()[1] == "unused", before.stdout
            for i in range(3):
                await client.call("submit", {"request": f"api work {i}"})
        stop = await tally(tmp_path, "stop", timeout=60)
        assert stop.returncode == 0, stop.stderr
        assert "3 runs in flight drain" in stop.stderr, stop.stderr
        assert stop.stderr.rstrip().endswith("tally: stopped"), stop.stderr
        assert _exited(daemon.pid), "tally stop said stopped while the daemon still ran"
        code = await asyncio.to_thread(daemon.wait, 10)
        assert code == 0, code
        offline = await tally(tmp_path, "runs")
        assert offline.returncode == 0, offline.stderr
        assert offline.stdout.count(" interrupted ") == 3, offline.stdout
        assert "read the runs from the record" in offline.stderr, offline.stderr
        # the owner's snapshot is trusted, not "edited?"
        assert "seal" not in offline.stderr, offline.stderr
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()
