"""CLI commands that ask the running (real) daemon over its socket."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from daemon.service import Daemon
from surfaces.cli import main


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
        f"{'RUN':<24} {'STATE':<16} {'LANE':<14} REQUEST",
        "(no runs)",
    ]
    run = await daemon.engine.submit("the api")
    await daemon.engine.wait(run.id, timeout=20)
    assert await asyncio.to_thread(main, ["runs", *socket]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["RUN", "STATE", "LANE", "REQUEST"]
    assert lines[1].split()[:2] == [run.id, "done"]
    assert len(lines) == 2
    assert await asyncio.to_thread(main, ["runs", "--json", *socket]) == 0
    assert [r["id"] for r in json.loads(capsys.readouterr().out)] == [run.id]
