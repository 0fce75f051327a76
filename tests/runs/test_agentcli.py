"""Agent-cli members through the real Daemon: a scripted CLI (tests/runs/fakecli.py) run in
real bubblewrap on a real git workspace's view, beside the scripted model server.

Each test reads the record: the `agent.cli` entries, the task's diff, its checks and verdicts.
Faults: a CLI that hangs (its whole tree is killed), floods its output (bounded), exits
non-zero, tries to leave its view (refused), or changes nothing (its checks decide).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
import os
import shutil
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from daemon.runs import entries as k
from daemon.runs.agentcli import AGENT_CLI
from daemon.service import Daemon
from daemon.workspace import record as ws
from tests.runs import fakecli
from tests.runs.model_server import Reply, ScriptedServer, settings_for
from tests.workspace.repo import BUGGY, FIXED, project

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")

SECRET = "fake-secret-value-0123456789"
ADDS_UP = [sys.executable, "-c", "from calc import add; assert add(2, 3) == 5, 'add is wrong'"]

Make = Callable[..., Any]


def roster_text(url: str, cli: Path, argv: list[str], lane_tier: str, **member: Any) -> str:
    fields = {
        "name": "cli",
        "kind": "agent-cli",
        "argv": [str(cli), *argv],
        "ro_binds": [str(cli.parent)],
        "env": ["FAKE_KEY"],
        "slots": 2,
        **member,
    }
    table = "".join(f"{key} = {json.dumps(value)}\n" for key, value in fields.items())
    return f"""version = 1
[policy]
max_parallel = 2
attempts_per_rung = 2

[[models]]
name = "tiny"
url = "{url}"
slots = 2

[[models]]
{table}
[tiers]
ladder = ["cheap", "agents"]
cheap = ["tiny"]
agents = ["cli"]

[[lanes]]
name = "testing"
keywords = ["testing"]
tier = "{lane_tier}"
system = "You fix code so its tests pass."
"""


@pytest.fixture
async def cli_fleet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Make]:
    """cli_fleet(argv, lane_tier="agents", rules=[], **member) -> (daemon, server, cli)."""
    monkeypatch.setenv("FAKE_KEY", SECRET)
    made: list[tuple[Daemon, ScriptedServer]] = []
    cli = fakecli.write(tmp_path / "cli")
    project(tmp_path / "src")

    async def make(
        argv: list[str],
        lane_tier: str = "agents",
        rules: list[tuple[str, Reply, float]] | None = None,
        **member: Any,
    ) -> tuple[Daemon, ScriptedServer, Path]:
        server = ScriptedServer(rules or [], default="nothing to say")
        await server.start()
        text = roster_text(server.url, cli, argv, lane_tier, **member)
        daemon = Daemon(settings_for(tmp_path, text, workspace_roots=(tmp_path / "src",)))
        await daemon.start()
        made.append((daemon, server))
        return daemon, server, cli

    yield make
    for daemon, server in made:
        await daemon.stop()
        await server.stop()


async def bodies(daemon: Daemon, kind: str, run: str) -> list[Any]:
    found = await daemon.ledger.entries(start=0, limit=10_000, kind=kind, run=run)
    return [(await daemon.ledger.body(e.body)).value for e in found]


async def submit(daemon: Daemon, tmp_path: Path, checks: list[list[str]] | None = None) -> Any:
    plan = {
        "tasks": [
            {
                "id": "fix",
                "lane": "testing",
                "instruction": "Fix add in calc.py so that add(2, 3) == 5",
                "assertions": [{"type": "run", "argv": a} for a in (checks or [ADDS_UP])],
            }
        ]
    }
    view = await daemon.engine.submit(
        "Fix add in calc.py", plan=plan, workspace=str(tmp_path / "src" / "project")
    )
    return await daemon.engine.wait(view.id, timeout=120)


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


async def test_the_cli_edits_the_view_its_check_fails_and_the_informed_retry_passes(
    tmp_path: Path, cli_fleet: Make
) -> None:
    daemon, server, cli = await cli_fleet(["fix"])
    done = await submit(daemon, tmp_path)
    assert done.state == "done", done.error
    verdicts = await bodies(daemon, k.TASK_VERDICT, done.id)
    assert [(v["attempt"], v["next"]) for v in verdicts] == [(1, "retry"), (2, "done")]
    assert "add is wrong" in verdicts[0]["failures"][0]  # the check's own output
    calls = await bodies(daemon, AGENT_CLI, done.id)
    diffs = await bodies(daemon, ws.TASK_DIFF, done.id)
    assert len(calls) == len(diffs) == 2
    for call, diff in zip(calls, diffs, strict=True):
        assert call["argv"] == [str(cli), "fix"]  # as configured
        assert call["member"] == "cli"
        assert call["prompt"] == "stdin"
        assert call["env"] == ["FAKE_KEY"]
        assert call["exit_code"] == 0
        assert not call["timed_out"]
        assert call["files"] == diff["files"] == ["calc.py"]
        assert call["diff_sha256"] == sha(diff["diff"])
        assert call["stdout_sha256"] == sha(call["stdout_head"])
        assert "[env FAKE_KEY]" in call["stdout_head"]  # its value, printed, is hidden
        assert "home /tmp" in call["stdout_head"]  # caches stay out of the view
    assert calls[0]["prompt_sha256"] != calls[1]["prompt_sha256"]  # feedback in the second
    assert "a * b" in diffs[0]["diff"]
    assert "a + b" in diffs[1]["diff"]
    _, patch = await daemon.engine.patch(done.id)
    assert patch is not None
    assert patch.files == ["calc.py"]
    assert (tmp_path / "src" / "project" / "calc.py").read_text() == BUGGY  # until apply
    results = await bodies(daemon, k.TASK_RESULT, done.id)
    assert "edited calc.py (right)" in results[-1]["output"]
    assert server.requests == []  # an agent CLI is no model call
    # The key's value is nowhere in the record: not in an entry, not in a body.
    for entry in await daemon.ledger.entries(start=0, limit=10_000, run=done.id):
        assert SECRET not in entry.model_dump_json()
        if entry.body is not None:
            assert SECRET not in json.dumps((await daemon.ledger.body(entry.body)).value)
    assert (await daemon.ledger.verify(deep=True)).ok


async def test_escalation_climbs_from_the_local_model_to_the_agent_cli(
    tmp_path: Path, cli_fleet: Make
) -> None:
    wrong = "calc.py\n```python\ndef add(a, b):\n    return a * b\n```\n"
    daemon, server, _ = await cli_fleet(["fix"], lane_tier="cheap", rules=[("Fix add", wrong, 0)])
    done = await submit(daemon, tmp_path)
    assert done.state == "done", done.error
    starts = await bodies(daemon, k.TASK_START, done.id)
    assert [s["tier"] for s in starts] == ["cheap", "cheap", "agents"]
    calls = await bodies(daemon, AGENT_CLI, done.id)
    assert len(calls) == 1
    assert len(server.requests) == 2  # the model's two tries on its rung
    diffs = await bodies(daemon, ws.TASK_DIFF, done.id)
    assert FIXED.strip().splitlines()[-1].strip() in diffs[-1]["diff"]


@pytest.mark.parametrize(
    ("how", "argv"), [("file", ["echo", "{prompt_file}"]), ("arg", ["echo", "{prompt}"])]
)
async def test_the_prompt_reaches_the_cli_in_a_file_or_an_argument(
    tmp_path: Path, cli_fleet: Make, how: str, argv: list[str]
) -> None:
    daemon, _, cli = await cli_fleet(argv, prompt=how)
    view = await daemon.engine.submit("Say what {workspace} holds", lane="testing")
    done = await daemon.engine.wait(view.id, timeout=60)
    assert done.state == "done", done.error
    (call,) = await bodies(daemon, AGENT_CLI, done.id)
    assert call["argv"] == [str(cli), *argv]  # the placeholder, never the prompt or a path
    assert call["prompt"] == how
    assert "Say what {workspace} holds" in call["stdout_head"]  # expanded once, not twice
    assert "listing []" in call["stdout_head"]  # no view: an empty dir of its own
    assert call["diff_sha256"] is None


async def test_a_hanging_cli_is_killed_with_everything_it_started(
    tmp_path: Path, cli_fleet: Make
) -> None:
    daemon, _, _ = await cli_fleet(["hang"], request_timeout_s=2)
    done = await submit(daemon, tmp_path)
    assert done.state == "failed"
    calls = await bodies(daemon, AGENT_CLI, done.id)
    assert len(calls) == 2  # each attempt timed out
    assert all(c["timed_out"] and c["exit_code"] is None for c in calls)
    assert all(1500 <= c["duration_ms"] < 10_000 for c in calls)
    results = await bodies(daemon, k.TASK_RESULT, done.id)
    assert "timed out" in results[0]["error"]
    assert fakecli.leftovers("987.654") == []  # the grandchild in its own session too


async def test_a_flooding_cli_is_bounded(tmp_path: Path, cli_fleet: Make) -> None:
    daemon, _, _ = await cli_fleet(["flood"])
    done = await submit(daemon, tmp_path, checks=[["true"]])
    assert done.state == "done", done.error
    (call,) = await bodies(daemon, AGENT_CLI, done.id)
    assert call["truncated"]
    assert call["stdout_chars"] <= 64 * 1024
    assert len(call["stdout_head"]) <= 2000
    (result,) = await bodies(daemon, k.TASK_RESULT, done.id)
    assert len(result["output"]) <= 64 * 1024


async def test_a_cli_that_exits_non_zero_fails_its_attempt_with_its_stderr(
    tmp_path: Path, cli_fleet: Make
) -> None:
    daemon, _, _ = await cli_fleet(["fail"])
    done = await submit(daemon, tmp_path)
    assert done.state == "failed"
    calls = await bodies(daemon, AGENT_CLI, done.id)
    assert [c["exit_code"] for c in calls] == [3, 3]
    assert "boom" in calls[0]["stderr_tail"]
    results = await bodies(daemon, k.TASK_RESULT, done.id)
    assert "exited 3: boom: the agent could not finish" in results[0]["error"]
    verdicts = await bodies(daemon, k.TASK_VERDICT, done.id)
    assert [v["next"] for v in verdicts] == ["retry", "failed"]


async def test_a_cli_cannot_leave_its_view_see_the_state_dir_or_reach_the_network(
    tmp_path: Path, cli_fleet: Make
) -> None:
    outside = tmp_path / "src" / "project" / "calc.py"  # the user's own file, by its path
    server = ScriptedServer([], default="x")
    await server.start()
    try:
        argv = ["escape", str(tmp_path / "state"), str(outside), str(server.port)]
        daemon, _, cli = await cli_fleet(argv)
        before = cli.read_text()
        done = await submit(daemon, tmp_path, checks=[["true"]])
        assert done.state == "done", done.error
        (call,) = await bodies(daemon, AGENT_CLI, done.id)
        out = call["stdout_head"]
        for what in ("write outside", "write /etc", "write own binary", "list state", "network"):
            assert f"{what}: refused" in out, out
        assert "write view: ALLOWED" in out
        assert call["files"] == ["inside.txt"]
        assert outside.read_text() == BUGGY
        assert not await asyncio.to_thread(os.path.exists, "/etc/tally-escaped")
        assert cli.read_text() == before
    finally:
        await server.stop()


async def test_a_cli_that_changes_nothing_leaves_an_empty_diff_and_its_checks_decide(
    tmp_path: Path, cli_fleet: Make
) -> None:
    daemon, _, _ = await cli_fleet(["nothing"])
    done = await submit(daemon, tmp_path, checks=[["test", "-f", "NOTES.md"]])
    assert done.state == "failed"
    calls = await bodies(daemon, AGENT_CLI, done.id)
    assert [(c["files"], c["diff_sha256"]) for c in calls] == [([], sha(""))] * 2
    verdicts = await bodies(daemon, k.TASK_VERDICT, done.id)
    assert "test -f NOTES.md" in verdicts[0]["failures"][0]
    _, patch = await daemon.engine.patch(done.id)
    assert patch is None or patch.files == []


async def test_a_missing_or_unbound_program_fails_the_attempt_with_what_to_do(
    tmp_path: Path, cli_fleet: Make
) -> None:
    hidden = fakecli.write(tmp_path / "elsewhere")  # not in the member's ro_binds
    daemon, _, _ = await cli_fleet([])
    member = daemon.roster.member("cli")
    assert member is not None
    for program, said in (
        (str(tmp_path / "nope" / "cli"), "is not an executable file"),
        (str(hidden), "outside what the sandbox shows"),
    ):
        roster = daemon.roster.model_copy(
            update={
                "models": [
                    m if m.name != "cli" else member.model_copy(update={"argv": [program, "fix"]})
                    for m in daemon.roster.models
                ]
            }
        )
        daemon.engine.setting.use(roster)
        done = await submit(daemon, tmp_path)
        assert done.state == "failed"
        results = await bodies(daemon, k.TASK_RESULT, done.id)
        assert said in results[0]["error"], results[0]["error"]
        assert await bodies(daemon, AGENT_CLI, done.id) == []  # nothing ran


async def test_cancelling_the_run_kills_the_cli_and_everything_it_started(
    tmp_path: Path, cli_fleet: Make
) -> None:
    daemon, _, _ = await cli_fleet(["hang"], request_timeout_s=300)
    plan = {"tasks": [{"id": "t", "lane": "testing", "instruction": "wait"}]}
    view = await daemon.engine.submit("wait", plan=plan)
    for _ in range(200):  # until its grandchild runs
        if fakecli.leftovers("987.654"):
            break
        await asyncio.sleep(0.05)
    assert fakecli.leftovers("987.654")
    await daemon.engine.cancel(view.id)
    done = await daemon.engine.wait(view.id, timeout=30)
    assert done.state == "cancelled"
    for _ in range(40):  # SIGKILL to the namespace: gone within moments
        if not fakecli.leftovers("987.654"):
            break
        await asyncio.sleep(0.05)
    assert fakecli.leftovers("987.654") == []


async def test_a_members_slots_bound_its_calls_at_once(tmp_path: Path, cli_fleet: Make) -> None:
    daemon, _, _ = await cli_fleet(["span"], slots=1)
    tasks = [{"id": f"t{i}", "lane": "testing", "instruction": f"part {i}"} for i in range(3)]
    view = await daemon.engine.submit("three parts", plan={"tasks": tasks}, max_parallel=3)
    done = await daemon.engine.wait(view.id, timeout=60)
    assert all(t.state == "done" for t in done.tasks), done.error
    calls = await bodies(daemon, AGENT_CLI, done.id)
    spans = sorted(tuple(map(float, c["stdout_head"].split()[1:3])) for c in calls)
    assert len(spans) == 3
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert end <= start  # one at a time: slots = 1


async def test_with_its_network_grant_the_cli_reaches_the_host_and_still_not_the_state_dir(
    tmp_path: Path, cli_fleet: Make
) -> None:
    server = ScriptedServer([], default="x")
    await server.start()
    try:
        argv = ["escape", str(tmp_path / "state"), "/nonexistent/x", str(server.port)]
        daemon, _, _ = await cli_fleet(argv, network=True)
        done = await submit(daemon, tmp_path, checks=[["true"]])
        assert done.state == "done", done.error
        (call,) = await bodies(daemon, AGENT_CLI, done.id)
        assert "network: ALLOWED" in call["stdout_head"]
        assert "list state: refused" in call["stdout_head"]
        assert call["network"] is True
    finally:
        await server.stop()
