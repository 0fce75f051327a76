"""The work made visible by the CLI, against the real daemon on its unix socket: tokens stream
as tasks write them, named by task (a pty as a terminal sees it, and `--stream` forcing it);
`tally run ID` lists every attempt with its failures and its climb; a failed run prints the
work its done tasks did and says how to retry it; `tally retry` reuses that work."""

from __future__ import annotations

import asyncio
import json
import os
import pty
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from daemon.service import Daemon
from surfaces.cli import main
from tests.slots.fake_server import FakeServer
from tests.surfaces.conftest import two_tasks

ROOT = Path(__file__).resolve().parents[2]
Capsys = pytest.CaptureFixture[str]


def failing_plan() -> dict[str, Any]:
    """T1 passes; T2's check fails on every rung (the fake server never writes `zzz`)."""
    plan = two_tasks()
    plan["tasks"][1]["assertions"] = [{"type": "contains", "text": "zzz"}]
    return plan


async def test_submit_streams_each_tasks_tokens_named_by_task(
    unix_server: Path, daemon: Daemon, capsys: Capsys, tmp_path: Path
) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(two_tasks()))
    argv = ["submit", "build the api", "--plan", str(plan), "--stream"]
    assert await asyncio.to_thread(main, [*argv, "--socket", str(unix_server)]) == 0
    out = capsys.readouterr().out
    [run] = daemon.engine.list()
    heads = [line for line in out.splitlines() if line.startswith("── ")]
    assert heads == ["── T1 ──", "── T2 ──", "── synthesis ──", "── answer ──"]
    t1 = out.split("── T1 ──\n", 1)[1].split("\n── T2 ──", 1)[0]
    assert t1 == (run.task("T1").result or "")  # type: ignore[union-attr]  # every token, once
    assert out.rstrip().endswith((run.answer or "").rstrip())


def _in_a_pty(argv: list[str]) -> tuple[int, str]:
    """Run the CLI with stdin, stdout and stderr on a pseudo-terminal; (exit code, output)."""
    master, slave = pty.openpty()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TALLY_")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "surfaces", *argv],
        stdin=slave,
        stdout=slave,
        stderr=slave,
        cwd=ROOT,
        env=env,
    )
    os.close(slave)
    chunks: list[bytes] = []
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the child closed its end
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(master)
    return proc.wait(timeout=60), b"".join(chunks).decode(errors="replace")


async def test_on_a_terminal_submit_streams_the_writing_task_and_prints_it_once(
    unix_server: Path, daemon: Daemon, model: FakeServer
) -> None:
    model.token_delay_s = 0.004  # tokens come while the CLI follows, as from a real model
    code, seen = await asyncio.to_thread(
        _in_a_pty, ["submit", "build the api server", "--socket", str(unix_server)]
    )
    assert code == 0, seen
    [run] = daemon.engine.list()
    lines = seen.replace("\r\n", "\n").split("\n")
    assert "── t1 ──" in lines
    answer = (run.answer or "").strip()
    assert answer
    text = seen.replace("\r\n", "\n")
    last = answer.split()[-1]
    assert text.count(last + " ") + text.count(last + "\n") == 1  # not printed a second time
    # from its first token, though the stream opened after the task began to write
    assert "".join(text.split("── t1 ──\n", 1)[1].split()).startswith("t0t1t2")
    assert f"{run.id} done" in text  # the status, as lines of their own


async def test_a_failed_run_shows_its_work_its_attempts_and_how_to_retry(
    unix_server: Path, daemon: Daemon, capsys: Capsys, tmp_path: Path
) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(failing_plan()))
    argv = ["submit", "build the api", "--plan", str(plan), "--socket", str(unix_server)]
    assert await asyncio.to_thread(main, argv) == 1
    captured = capsys.readouterr()
    [run] = daemon.engine.list()
    assert run.state == "failed"
    t1 = run.task("T1")
    assert t1 is not None
    assert t1.result
    assert t1.result.strip()[:200] in captured.out  # the partial answer: T1's work
    assert f"tally retry {run.id}" in captured.err
    assert f"tally run {run.id}" in captured.err

    argv = ["run", run.id, "--socket", str(unix_server)]
    assert await asyncio.to_thread(main, argv) == 0
    out = capsys.readouterr().out
    t2 = out.split("task T2 ", 1)[1]
    assert "attempt 1 on cheap" in t2
    assert "call to tiny" in t2
    assert "failed → retry" in t2  # [policy] attempts_per_rung = 2: the same rung, told why
    assert "attempt 2 on cheap" in t2
    assert "failed → escalate" in t2
    assert "zzz" in t2  # the failed check, in its own words
    assert "climbs cheap → capable" in t2
    assert "attempt 3 on capable" in t2
    assert "told: " in t2  # the second attempt's feedback
    assert "failed → failed" in t2
    t1_part = out.split("task T1 ", 1)[1].split("task T2 ", 1)[0]
    assert "attempt 1 on cheap" in t1_part
    assert "passed → done" in t1_part

    argv = ["retry", run.id, "--no-stream", "--socket", str(unix_server)]
    assert await asyncio.to_thread(main, argv) == 1  # T2 fails again: the model is the same
    err = capsys.readouterr().err
    retried = next(v for v in daemon.engine.list() if v.retry_of == run.id)
    assert f"run {retried.id} retries {run.id}, reusing T1" in err
    t1_again = retried.task("T1")
    assert t1_again is not None
    assert (t1_again.state, t1_again.attempts, t1_again.reused_from) == ("done", 0, run.id)
    argv = ["run", retried.id, "--socket", str(unix_server)]
    assert await asyncio.to_thread(main, argv) == 0
    out = capsys.readouterr().out
    assert f"retries run {run.id}" in out
    assert f"reused, done in run {run.id}" in out
