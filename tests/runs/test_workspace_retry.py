"""`tally retry` of a run that worked on a workspace: real git, real bwrap, the scripted model.

A retry takes the workspace as it is now, carries each reused task's recorded diff onto that
snapshot (witnessed: `workspace.carry`, then per task `task.reuse` and `task.diff`), runs only
what was not done, and its combined patch applies to the workspace. A reused diff that no
longer applies makes its task (and the tasks that need it) run again, and the record says
why; a workspace gone or no longer a git repository is refused with nothing witnessed.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from daemon.errors import Conflict
from daemon.runs import entries as k
from daemon.service import Daemon
from daemon.workspace import record as ws
from tests.runs.model_server import Reply, ScriptedServer, roster_toml, settings_for
from tests.runs.test_workspace_runs import LANES, RIGHT, bodies, tool
from tests.workspace.repo import BUGGY, FIXED, git, project

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")

# The check runs the new test without pytest's start-up (seconds each on a busy machine).
CHECK = [sys.executable, "-c", "from test_more import test_more; test_more()"]
MORE = "test_more.py\n```python\nfrom calc import add\n\n\ndef test_more():\n    assert {}\n```\n"
FAILING = MORE.format("add(1, 1) == 3")
PASSING = MORE.format("add(1, 1) == 2")
PLAN: dict[str, Any] = {
    "tasks": [
        {"id": "fix", "lane": "backend", "instruction": "Fix add in calc.py"},
        {
            "id": "cover",
            "lane": "backend",
            "instruction": "Add a test of add in test_more.py",
            "needs": ["fix"],
            "assertions": [{"type": "run", "argv": CHECK, "timeout_s": 60}],
        },
    ]
}
ORIGINAL: list[tuple[str, Reply, float]] = [("Fix add", RIGHT, 0.0), ("Add a test", FAILING, 0.0)]
RETRIED: list[tuple[str, Reply, float]] = [("Fix add", RIGHT, 0.0), ("Add a test", PASSING, 0.0)]

Make = Callable[..., Any]


@pytest.fixture
async def fleet(tmp_path: Path) -> AsyncIterator[tuple[Daemon, ScriptedServer]]:
    server = ScriptedServer(list(ORIGINAL), default="nothing to say")
    await server.start()
    roster = roster_toml(server.url, lanes=LANES, attempts_per_rung=1)
    daemon = Daemon(settings_for(tmp_path, roster, workspace_roots=(tmp_path / "src",)))
    await daemon.start()
    try:
        yield daemon, server
    finally:
        await daemon.stop()
        await server.stop()


def project_passes(where: Path) -> bool:
    """The project's tests pass in `where` (run without pytest: its start-up takes seconds)."""
    script = "from test_calc import test_add; test_add()\n"
    if (where / "test_more.py").exists():
        script += "from test_more import test_more; test_more()\n"
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=where, capture_output=True, timeout=60, check=False
    )
    return done.returncode == 0


def asked(server: ScriptedServer, needle: str) -> int:
    return sum(
        1
        for body in server.requests
        if any(needle in str(m.get("content")) for m in body.get("messages", []))
    )


async def failed_run(daemon: Daemon, src: Path) -> str:
    view = await daemon.engine.submit("fix and cover", plan=PLAN, workspace=str(src))
    failed = await daemon.engine.wait(view.id, timeout=120)
    assert failed.state == "failed", failed.error
    assert [t.state for t in failed.tasks] == ["done", "failed"]
    return view.id


async def test_retry_after_a_failed_check_reuses_the_fix_and_reruns_the_rest(
    tmp_path: Path, fleet: tuple[Daemon, ScriptedServer]
) -> None:
    daemon, server = fleet
    src = project(tmp_path / "src")
    first = await failed_run(daemon, src)
    checks = await bodies(daemon, ws.CHECK_RUN, first)
    assert checks
    assert all(c["exit_code"] == 1 for c in checks)
    assert asked(server, "Fix add") == 1
    server.rules = list(RETRIED)
    again = await tool(daemon, "run_retry", {"run_id": first}, scope="command")
    done = await daemon.engine.wait(again.id, timeout=120)
    assert done.state == "done", done.error
    assert done.retry_of == first
    assert done.workspace == str(src.resolve())
    assert asked(server, "Fix add") == 1  # the fix was carried, not asked for again
    fix, cover = done.task("fix"), done.task("cover")
    assert fix is not None
    assert cover is not None
    assert (fix.state, fix.reused_from, fix.attempts) == ("done", first, 0)
    assert (cover.state, cover.reused_from, cover.attempts) == ("done", None, 1)
    # witnessed: the fresh snapshot, the carry, the reuse and the carried diff, in that order
    [snapshot] = await bodies(daemon, ws.SNAPSHOT, done.id)
    [original_snapshot] = await bodies(daemon, ws.SNAPSHOT, first)
    assert snapshot["content"] == original_snapshot["content"]  # nothing changed meanwhile
    [carry] = await bodies(daemon, ws.CARRY, done.id)
    assert carry == {
        "from_run": first,
        "from_content": original_snapshot["content"],
        "content": snapshot["content"],
        "carried": ["fix"],
        "changed": {},
        "redo": {},
    }
    found = await daemon.ledger.entries(start=done.request_seq, limit=1000, run=done.id)
    kinds = [e.kind for e in found]
    assert kinds.index(ws.CARRY) < kinds.index(k.TASK_REUSE) < kinds.index(ws.TASK_DIFF)
    reuse_entry = found[kinds.index(k.TASK_REUSE)]
    carried_diff = found[kinds.index(ws.TASK_DIFF)]
    assert carried_diff.parent == reuse_entry.seq
    diffs = await bodies(daemon, ws.TASK_DIFF, done.id)
    assert [(d["task"], d["attempt"], d["files"]) for d in diffs] == [
        ("fix", 0, ["calc.py"]),
        ("cover", 1, ["test_more.py"]),
    ]
    # the cover task's view held the carried fix: its check ran the fixed add
    [check] = await bodies(daemon, ws.CHECK_RUN, done.id)
    assert check["exit_code"] == 0
    # the combined patch holds both tasks' changes; the workspace is untouched until apply
    _view, patch = await daemon.engine.patch(done.id)
    assert patch is not None
    assert (patch.tasks, sorted(patch.files)) == (["fix", "cover"], ["calc.py", "test_more.py"])
    assert (src / "calc.py").read_text() == BUGGY
    assert not (src / "test_more.py").exists()
    applied = await tool(daemon, "run_apply", {"run_id": done.id}, scope="command")
    assert applied.applied
    assert (src / "calc.py").read_text() == FIXED
    assert project_passes(src)
    # replay rebuilds the retried run as it ran
    from daemon.runs.replay import replay

    replayed = (await replay(daemon.ledger, run=done.id))[done.id]
    assert replayed.task("fix") == done.task("fix")
    assert replayed.patch_files == done.patch_files


async def test_retry_after_the_user_edited_other_files_carries_the_fix(
    tmp_path: Path, fleet: tuple[Daemon, ScriptedServer]
) -> None:
    daemon, server = fleet
    src = project(tmp_path / "src")
    first = await failed_run(daemon, src)
    # meanwhile the user writes notes (untracked) and commits a new module
    (src / "notes.txt").write_text("remember the milk\n")
    (src / "extra.py").write_text("VALUE = 1\n")
    git(src, "add", "extra.py")
    git(src, "commit", "-q", "-m", "extra")
    server.rules = list(RETRIED)
    again = await daemon.engine.retry(first)
    done = await daemon.engine.wait(again.id, timeout=120)
    assert done.state == "done", done.error
    assert asked(server, "Fix add") == 1
    [carry] = await bodies(daemon, ws.CARRY, done.id)
    assert carry["from_content"] != carry["content"]  # the workspace changed…
    assert (carry["carried"], carry["changed"], carry["redo"]) == (["fix"], {}, {})  # …not calc.py
    [snapshot] = await bodies(daemon, ws.SNAPSHOT, done.id)
    assert snapshot["files"] == 5  # calc, test_calc, .gitignore, notes, extra
    _, patch = await daemon.engine.patch(done.id)
    assert patch is not None
    assert sorted(patch.files) == ["calc.py", "test_more.py"]
    applied = await tool(daemon, "run_apply", {"run_id": done.id}, scope="command")
    assert applied.applied
    assert (src / "calc.py").read_text() == FIXED
    assert (src / "notes.txt").read_text() == "remember the milk\n"
    assert project_passes(src)


async def test_a_reused_diff_that_no_longer_applies_runs_its_task_again(
    tmp_path: Path, fleet: tuple[Daemon, ScriptedServer]
) -> None:
    daemon, server = fleet
    src = project(tmp_path / "src")
    first = await failed_run(daemon, src)
    (src / "calc.py").write_text("def add(a, b):\n    return a - b  # why?\n")  # the user edits
    server.rules = list(RETRIED)
    again = await daemon.engine.retry(first)
    done = await daemon.engine.wait(again.id, timeout=120)
    assert done.state == "done", done.error
    assert asked(server, "Fix add") == 2  # the fix ran again, on calc.py as it is now
    fix = done.task("fix")
    assert fix is not None
    assert (fix.reused_from, fix.attempts) == (None, 1)
    [carry] = await bodies(daemon, ws.CARRY, done.id)
    assert carry["carried"] == []
    assert list(carry["redo"]) == ["fix"]
    assert "does not apply" in carry["redo"]["fix"]
    assert "calc.py" in carry["redo"]["fix"]
    assert "changed since" in carry["redo"]["fix"]
    assert await bodies(daemon, k.TASK_REUSE, done.id) == []
    _, patch = await daemon.engine.patch(done.id)
    assert patch is not None
    assert sorted(patch.files) == ["calc.py", "test_more.py"]
    applied = await tool(daemon, "run_apply", {"run_id": done.id}, scope="command")
    assert applied.applied
    assert project_passes(src)


async def test_a_dependant_of_a_task_that_runs_again_runs_again_too(
    tmp_path: Path, fleet: tuple[Daemon, ScriptedServer]
) -> None:
    daemon, server = fleet
    src = project(tmp_path / "src")
    plan = {
        "tasks": [
            PLAN["tasks"][0],
            {"id": "docs", "lane": "backend", "instruction": "Write NOTES.md", "needs": ["fix"]},
            PLAN["tasks"][1],
        ]
    }
    server.rules = [*ORIGINAL, ("Write NOTES.md", "NOTES.md\n```\nadd adds\n```\n", 0.0)]
    view = await daemon.engine.submit("three", plan=plan, workspace=str(src))
    failed = await daemon.engine.wait(view.id, timeout=120)
    assert [t.state for t in failed.tasks] == ["done", "done", "failed"]
    (src / "calc.py").write_text("def add(a, b):\n    return a - b  # why?\n")
    server.rules = [*RETRIED, ("Write NOTES.md", "NOTES.md\n```\nadd adds\n```\n", 0.0)]
    done = await daemon.engine.wait((await daemon.engine.retry(view.id)).id, timeout=120)
    assert done.state == "done", done.error
    [carry] = await bodies(daemon, ws.CARRY, done.id)
    assert set(carry["redo"]) == {"fix", "docs"}
    assert carry["redo"]["docs"].startswith("it needs fix, which runs again")
    assert asked(server, "Write NOTES.md") == 2


async def test_retry_refuses_a_workspace_gone_or_no_longer_a_repository(
    tmp_path: Path, fleet: tuple[Daemon, ScriptedServer]
) -> None:
    daemon, _ = fleet
    src = project(tmp_path / "src")
    first = await failed_run(daemon, src)
    tasks_root = daemon.engine.options.confinement.tasks_root
    dirs = sorted(p.name for p in tasks_root.glob("tally-task-ws-*")) if tasks_root else []
    size = daemon.ledger.size
    shutil.rmtree(src / ".git")
    with pytest.raises(Conflict) as refused:
        await daemon.engine.retry(first)
    said = str(refused.value)
    assert f"worked on {src.resolve()} as a git repository" in said
    assert f"restore {src.resolve()}/.git" in said
    assert "tally submit --workspace" in said
    moved = tmp_path / "src" / "moved"
    src.rename(moved)
    with pytest.raises(Conflict) as gone:
        await tool(daemon, "run_retry", {"run_id": first}, scope="command")
    said = str(gone.value)
    assert f"the workspace {src.resolve()}, which is no longer a directory" in said
    assert "put it back" in said
    assert daemon.ledger.size == size  # nothing witnessed
    assert len(daemon.engine.list()) == 1
    after = sorted(p.name for p in tasks_root.glob("tally-task-ws-*")) if tasks_root else []
    assert after == dirs  # no copy left behind


async def test_a_retry_on_a_plain_directory_carries_the_fix_too(
    tmp_path: Path, fleet: tuple[Daemon, ScriptedServer]
) -> None:
    daemon, server = fleet
    src = project(tmp_path / "src", repo=False)
    first = await failed_run(daemon, src)
    server.rules = list(RETRIED)
    done = await daemon.engine.wait((await daemon.engine.retry(first)).id, timeout=120)
    assert done.state == "done", done.error
    assert asked(server, "Fix add") == 1
    [snapshot] = await bodies(daemon, ws.SNAPSHOT, done.id)
    assert snapshot["kind"] == "files"
    [carry] = await bodies(daemon, ws.CARRY, done.id)
    assert (carry["carried"], carry["redo"]) == (["fix"], {})
    assert (await tool(daemon, "run_apply", {"run_id": done.id}, scope="command")).applied
    assert project_passes(src)


async def test_a_retry_interrupted_after_its_carry_resumes_with_the_carried_changes(
    tmp_path: Path,
) -> None:
    """After a restart the retried run's copies are gone: the reused task's changes come back
    from its `task.diff` (attempt 0), and nothing is carried or asked for twice."""
    import asyncio

    src = project(tmp_path / "src")
    server = ScriptedServer(list(ORIGINAL), default="nothing to say")
    await server.start()
    roster = roster_toml(server.url, lanes=LANES, attempts_per_rung=1)
    settings = settings_for(tmp_path, roster, workspace_roots=(tmp_path / "src",))
    try:
        daemon = Daemon(settings)
        await daemon.start()
        try:
            first = await failed_run(daemon, src)
            server.rules = [("Fix add", RIGHT, 0.0), ("Add a test", PASSING, 60.0)]
            again = await daemon.engine.retry(first)
            for _ in range(400):
                if server.in_flight():
                    break
                await asyncio.sleep(0.05)
            assert server.in_flight() == 1  # the cover task is being written
        finally:
            await daemon.stop()
        server.rules = list(RETRIED)
        daemon = Daemon(settings)
        await daemon.start()
        try:
            assert daemon.engine.get(again.id).state == "interrupted"
            await daemon.engine.resume(again.id)
            done = await daemon.engine.wait(again.id, timeout=120)
            assert done.state == "done", done.error
            assert asked(server, "Fix add") == 1
            assert len(await bodies(daemon, ws.CARRY, again.id)) == 1
            assert len(await bodies(daemon, k.TASK_REUSE, again.id)) == 1
            _, patch = await daemon.engine.patch(again.id)
            assert patch is not None
            assert sorted(patch.files) == ["calc.py", "test_more.py"]
            assert (await tool(daemon, "run_apply", {"run_id": again.id}, scope="command")).applied
            assert project_passes(src)
        finally:
            await daemon.stop()
    finally:
        await server.stop()


async def test_the_cli_retries_a_workspace_run_and_tally_run_says_what_ran_again(
    tmp_path: Path,
    fleet: tuple[Daemon, ScriptedServer],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`tally submit --plan … --workspace` fails and points at `tally retry`; the user edits
    calc.py; `tally retry` runs the fix again and `tally run` says why, per task."""
    import asyncio
    import json

    from aiohttp import web

    from surfaces.cli import main
    from surfaces.http import HttpOptions, create_app

    daemon, server = fleet
    src = project(tmp_path / "src")
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(PLAN))
    sock = tmp_path / "sock" / "tally.sock"
    sock.parent.mkdir()
    runner = web.AppRunner(create_app(daemon, HttpOptions(keepalive_s=0.2)))
    await runner.setup()
    await web.UnixSite(runner, str(sock)).start()
    at = ["--socket", str(sock)]
    try:
        argv = ["submit", "fix and cover", "--plan", str(plan), "--workspace", str(src)]
        assert await asyncio.to_thread(main, [*argv, *at]) == 1
        [first] = daemon.engine.list()
        err = capsys.readouterr().err
        assert f"`tally retry {first.id}` runs what is not done again, on {src.resolve()}" in err
        (src / "calc.py").write_text("def add(a, b):\n    return a - b  # why?\n")
        server.rules = list(RETRIED)
        assert await asyncio.to_thread(main, ["retry", first.id, *at]) == 0
        err = capsys.readouterr().err
        assert f"reusing fix where their changes still apply to {src.resolve()}" in err
        [again] = [r for r in daemon.engine.list() if r.id != first.id]
        assert await asyncio.to_thread(main, ["run", again.id, *at]) == 0
        out = capsys.readouterr().out
        assert f"not reused from run {first.id}, runs again: its recorded diff does not" in out
        assert "Traceback" not in out
    finally:
        await runner.cleanup()
