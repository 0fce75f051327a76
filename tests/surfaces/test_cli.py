"""CLI commands that ask the running (real) daemon over its socket."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from daemon.service import Daemon
from surfaces.cli import main
from tests.surfaces.conftest import two_tasks


async def test_slots_asks_the_daemon(
    unix_server: Path, daemon: Daemon, capsys: pytest.CaptureFixture[str]
) -> None:
    await daemon.engine.wait((await daemon.engine.submit("the api")).id, timeout=20)
    code = await asyncio.to_thread(main, ["slots", "--socket", str(unix_server), "--json"])
    assert code == 0
    status = json.loads(capsys.readouterr().out)
    assert [m["name"] for m in status["members"]] == ["tiny", "big"]
    assert status["members"][0]["state"] == "ready"
    assert status["idle"] == 4
    assert await asyncio.to_thread(main, ["slots", "--socket", str(unix_server)]) == 0
    table = capsys.readouterr().out
    assert "MEMBER" in table
    assert "tiny" in table
    assert "0/4" in table  # busy/total slots of the member that served the run
    assert "big" in table  # never leased: listed with its state, no instance yet
    assert "tier cheap (tiny): 0 waiting" in table


def test_slots_without_a_daemon_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["slots", "--socket", str(tmp_path / "none.sock")]) == 1
    assert "daemon not running" in capsys.readouterr().err


@pytest.mark.parametrize("content", [None, "{not json"])
def test_submit_with_an_unreadable_plan_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str | None
) -> None:
    plan = tmp_path / "plan.json"
    if content is not None:
        plan.write_text(content)
    socket = str(tmp_path / "none.sock")
    assert main(["submit", "x", "--plan", str(plan), "--socket", socket]) == 2
    err = capsys.readouterr().err
    assert "cannot read the plan" in err
    assert "Traceback" not in err


def test_an_unexpected_error_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def broken(args: object) -> int:
        raise RuntimeError("boom")

    monkeypatch.delenv("TALLY_DEBUG", raising=False)
    monkeypatch.setattr("surfaces.cli.version.run", broken)
    assert main(["version"]) == 1
    err = capsys.readouterr().err
    assert err == "tally: RuntimeError: boom (TALLY_DEBUG=1 shows where)\n"


async def test_runs_prints_a_header_then_one_row_per_run(
    unix_server: Path, daemon: Daemon, capsys: pytest.CaptureFixture[str]
) -> None:
    socket = ["--socket", str(unix_server)]
    assert await asyncio.to_thread(main, ["runs", *socket]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"{'RUN':<24} {'STATE':<16} {'CREATED':<19} {'LANE':<14} REQUEST",
        "(no runs)",
    ]
    run = await daemon.engine.submit("the api")
    await daemon.engine.wait(run.id, timeout=20)
    assert await asyncio.to_thread(main, ["runs", *socket]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["RUN", "STATE", "CREATED", "LANE", "REQUEST"]
    assert lines[1].split()[:2] == [run.id, "done"]
    assert lines[1].split()[4] == "backend"  # after the local date and time it was created
    assert len(lines) == 2
    assert await asyncio.to_thread(main, ["runs", "--json", *socket]) == 0
    assert [r["id"] for r in json.loads(capsys.readouterr().out)] == [run.id]


async def test_submit_a_bad_plan_says_its_error_once(
    unix_server: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = tmp_path / "cycle.json"
    tasks = [
        {"id": "A", "lane": "backend", "instruction": "a", "needs": ["B"]},
        {"id": "B", "lane": "backend", "instruction": "b", "needs": ["A"]},
    ]
    plan.write_text(json.dumps({"tasks": tasks}))
    argv = ["submit", "x", "--plan", str(plan), "--socket", str(unix_server)]
    assert await asyncio.to_thread(main, argv) == 2
    err = capsys.readouterr().err
    assert err == "tally: invalid_plan: cycle: A -> B -> A (each task needs the next)\n"
    tasks[0]["lane"] = "nope"
    plan.write_text(json.dumps({"tasks": tasks}))
    assert await asyncio.to_thread(main, argv) == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "tally: invalid_plan:"
    assert len(lines) == 3
    assert len(set(lines)) == 3  # the cycle and the unknown lane, each once


async def test_submit_says_the_run_id_first_when_piped(
    unix_server: Path, daemon: Daemon, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["submit", "build the api", "--socket", str(unix_server)]
    assert await asyncio.to_thread(main, argv) == 0
    captured = capsys.readouterr()
    [run] = daemon.engine.list()
    first, *progress = captured.err.splitlines()
    assert first == f"tally: run {run.id}"
    # a log gets one line per change of state, not a redrawn line
    assert progress[0] == f"tally: {run.id} queued"
    assert progress[-1].startswith(f"tally: {run.id} done")
    assert len(progress) == len(set(progress))
    assert "\r" not in captured.err
    assert captured.out.strip() == (run.answer or "").strip()


async def test_run_shows_each_task_then_the_answer(
    unix_server: Path, daemon: Daemon, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(two_tasks()))
    argv = ["submit", "build the api", "--plan", str(plan), "--socket", str(unix_server)]
    assert await asyncio.to_thread(main, argv) == 0
    [run] = daemon.engine.list()
    capsys.readouterr()
    argv = ["run", run.id, "--socket", str(unix_server)]
    assert await asyncio.to_thread(main, argv) == 0
    out = capsys.readouterr().out
    heads = [line for line in out.splitlines() if line.startswith("task ")]
    assert len(heads) == 2
    assert heads[0].startswith("task T1 · done · lane backend · member tiny · 1 attempt · ")
    assert heads[0].endswith(" s")
    assert "answer:" in out
    for task in run.tasks:
        assert (task.result or "")[:200] in out
    argv = ["run", run.id, "--follow", "--socket", str(unix_server)]
    assert await asyncio.to_thread(main, argv) == 0  # a finished run: follows to its end at once


async def test_submit_live_line_starts_with_the_daemons_state(
    unix_server: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    argv = ["submit", "build the api", "--socket", str(unix_server)]
    assert await asyncio.to_thread(main, argv) == 0
    err = capsys.readouterr().err
    first, draws = err.split("\n", 1)
    assert first.startswith("tally: run ")
    run_id = first.removeprefix("tally: run ")
    frames = draws.split("\r\x1b[K")[1:]
    assert frames[0] == f"{run_id} queued"
    assert frames[-1].startswith(f"{run_id} done")
    assert frames[-1].endswith("\n")


def test_daemon_and_clients_read_the_same_socket_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from daemon.config import Settings
    from surfaces.client import Endpoint

    custom = tmp_path / "custom.sock"
    monkeypatch.setenv("TALLY_SOCKET", str(custom))
    monkeypatch.delenv("TALLY_URL", raising=False)
    assert Settings.from_env(state_dir=tmp_path / "state").socket_path == custom
    assert Endpoint.from_env().socket_path == custom
    # an explicit --socket still wins
    assert Settings.from_env(socket_path=tmp_path / "x.sock").socket_path == tmp_path / "x.sock"
