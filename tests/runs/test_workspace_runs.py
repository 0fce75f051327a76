"""Runs on a workspace through the real Daemon: real bwrap, real git, the scripted model.

The model answers with failing code first and with passing code once its prompt holds the
test failure: the run passes on attempt 2 through the lane's detected tests, the user's files
stay as they were until `run_apply`, and then the project's own tests pass.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from daemon.clients import Client
from daemon.errors import Conflict, Forbidden
from daemon.runs import entries as k
from daemon.service import Daemon
from daemon.tools import TOOLS
from daemon.tools.tool import ToolContext
from daemon.workspace import record as ws
from tests.runs.model_server import Reply, ScriptedServer, roster_toml, settings_for
from tests.workspace.repo import BUGGY, FIXED, project

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")

LANES = """[[lanes]]
name = "testing"
keywords = ["testing"]
tier = "cheap"
system = "You fix code so its tests pass."
checks = [{ type = "tests", timeout_s = 60 }]

[[lanes]]
name = "backend"
keywords = ["backend"]
tier = "cheap"
system = "You do backend work."
"""
# pytest runs inside the sandbox: a venv whose packages live elsewhere (a `.pth` file, as in a
# development checkout sharing another venv's) binds those dirs read-only too.
SITE = [p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()]
LANES += f"\n[policy.command]\nro_binds = {json.dumps(SITE)}\n"
WRONG = "calc.py\n```python\ndef add(a, b):\n    return a * b\n```\n"
RIGHT = "calc.py\n```python\n" + FIXED + "```\n"
RULES: list[tuple[str, Reply, float]] = [
    ("FAILED test_calc.py", RIGHT, 0.0),  # only once the feedback holds the failure
    ("Fix add", WRONG, 0.0),
]

Make = Callable[..., Any]


@pytest.fixture
async def workspace_fleet(tmp_path: Path) -> AsyncIterator[Make]:
    made: list[tuple[Daemon, ScriptedServer]] = []

    async def make(rules: list[tuple[str, Reply, float]], **policy: Any) -> tuple[Daemon, Any]:
        server = ScriptedServer(rules, default="nothing to say")
        await server.start()
        roster = roster_toml(server.url, lanes=LANES, **policy)
        daemon = Daemon(settings_for(tmp_path, roster, workspace_roots=(tmp_path / "src",)))
        await daemon.start()
        made.append((daemon, server))
        return daemon, server

    yield make
    for daemon, server in made:
        await daemon.stop()
        await server.stop()


async def bodies(daemon: Daemon, kind: str, run: str) -> list[Any]:
    found = await daemon.ledger.entries(start=0, limit=10_000, kind=kind, run=run)
    return [(await daemon.ledger.body(e.body)).value for e in found]


def user_texts(server: ScriptedServer) -> list[str]:
    return [
        "\n".join(str(m["content"]) for m in r["messages"] if m["role"] == "user")
        for r in server.requests
    ]


async def tool(daemon: Daemon, name: str, args: dict[str, Any], scope: str = "admin") -> Any:
    spec = TOOLS[name]
    ctx = ToolContext(client=Client(name="tester", scope=scope))  # type: ignore[arg-type]
    return await spec.handler(daemon, spec.input.model_validate(args), ctx)


def own_tests_pass(where: Path) -> bool:
    # The project's tests are plain asserts: loading the dev venv's pytest plugins (hypothesis,
    # schemathesis...) would spend seconds per run on what they never use.
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
        cwd=where,
        env=os.environ | {"PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"},
        capture_output=True,
        timeout=120,
        check=False,
    )
    return done.returncode == 0


async def test_informed_retry_fixes_the_bug_and_apply_brings_it_home(
    tmp_path: Path, workspace_fleet: Make
) -> None:
    src = project(tmp_path / "src")
    before = {p.name: p.read_bytes() for p in src.iterdir() if p.is_file()}
    daemon, server = await workspace_fleet(RULES)
    view = await daemon.engine.submit(
        "Fix add in calc.py so the tests pass", lane="testing", workspace=str(src)
    )
    done = await daemon.engine.wait(view.id, timeout=120)
    assert done.state == "done", done.error
    task = done.tasks[0]
    assert task.attempts == 2
    verdicts = await bodies(daemon, k.TASK_VERDICT, view.id)
    assert [(v["attempt"], v["next"]) for v in verdicts] == [(1, "retry"), (2, "done")]
    assert "FAILED test_calc.py" in verdicts[0]["failures"][0]
    starts = await bodies(daemon, k.TASK_START, view.id)
    assert starts[1]["tier"] == starts[0]["tier"] == "cheap"  # the same rung, informed
    assert any("FAILED test_calc.py" in f for f in starts[1]["feedback"])
    prompts = user_texts(server)
    assert "FAILED test_calc.py" not in prompts[0]
    assert BUGGY in prompts[0]  # the file its instruction names is in the prompt
    assert "test_calc.py" in prompts[0]  # in the listing
    assert ".env" not in prompts[0]
    assert "hunter2" not in "".join(prompts)
    assert "FAILED test_calc.py" in prompts[1]
    # witnessed: what the tasks saw, each attempt's diff and each check's output
    snap = (await bodies(daemon, ws.SNAPSHOT, view.id))[0]
    assert snap["kind"] == "git"
    assert snap["hidden"] == 2
    diffs = await bodies(daemon, ws.TASK_DIFF, view.id)
    assert [d["files"] for d in diffs] == [["calc.py"], ["calc.py"]]
    runs = await bodies(daemon, ws.CHECK_RUN, view.id)
    assert [r["exit_code"] for r in runs] == [1, 0]
    assert runs[0]["source"] == "lane"
    assert "-m pytest" in " ".join(runs[0]["argv"])
    # the patch: shown, not applied; the workspace untouched until apply
    shown = await tool(daemon, "run_patch", {"run_id": view.id})
    assert shown.files == ["calc.py"]
    assert "-    return a - b" in shown.patch
    assert "+    return a + b" in shown.patch
    assert {p.name: p.read_bytes() for p in src.iterdir() if p.is_file()} == before
    assert not own_tests_pass(src)
    checked = await tool(daemon, "run_apply", {"run_id": view.id, "check": True})
    assert not checked.applied
    assert (src / "calc.py").read_text() == BUGGY
    # writing the user's files needs the command scope (the surfaces enforce the registry's)
    assert TOOLS["run_apply"].scope == "command"
    assert TOOLS["run_patch"].scope == "read"
    applied = await tool(daemon, "run_apply", {"run_id": view.id}, scope="command")
    assert applied.applied
    assert applied.method == "git-3way"
    assert (src / "calc.py").read_text() == FIXED
    assert own_tests_pass(src)
    witnessed = await bodies(daemon, ws.APPLY, view.id)
    assert [(w["ok"], w["client"], w["files"]) for w in witnessed] == [
        (True, "tester", ["calc.py"])
    ]
    assert (await daemon.ledger.verify(deep=True)).ok
    # nothing of the run is left on disk
    assert not list((tmp_path / "src").parent.glob("**/tally-task-ws-*"))


async def test_apply_refuses_a_workspace_that_changed_under_the_patch(
    tmp_path: Path, workspace_fleet: Make
) -> None:
    src = project(tmp_path / "src")
    daemon, _ = await workspace_fleet([("Fix add", RIGHT, 0.0)])
    view = await daemon.engine.submit(
        "Fix add in calc.py so the tests pass", lane="testing", workspace=str(src)
    )
    done = await daemon.engine.wait(view.id, timeout=120)
    assert done.state == "done", done.error
    assert done.tasks[0].attempts == 1
    (src / "calc.py").write_text("def add(a, b):\n    return b - a\n")  # the user edits
    with pytest.raises(Conflict, match="changed since the run's snapshot"):
        await tool(daemon, "run_apply", {"run_id": view.id})
    assert (src / "calc.py").read_text() == "def add(a, b):\n    return b - a\n"
    refused = await bodies(daemon, ws.APPLY, view.id)
    assert [r["ok"] for r in refused] == [False]


async def test_a_failed_run_keeps_its_done_tasks_changes_as_its_patch(
    tmp_path: Path, workspace_fleet: Make
) -> None:
    # A new user's 2-task run failed on its second task: the first task's fix would be lost
    # without a retry. The done tasks' changes are the failed run's patch.
    src = project(tmp_path / "src")
    stray = "calc.py\n<<<<<<< SEARCH\nnot in the file\n=======\nx\n>>>>>>> REPLACE\n"
    daemon, _ = await workspace_fleet([("Fix add", RIGHT, 0.0), ("Tidy", stray, 0.0)])
    tidy: dict[str, Any] = {"id": "tidy", "lane": "backend", "instruction": "Tidy calc.py"}
    fix = {"id": "fix", "lane": "backend", "instruction": "Fix add in calc.py"}
    plan = {"tasks": [fix, tidy | {"needs": ["fix"]}]}
    view = await daemon.engine.submit("fix then tidy", plan=plan, workspace=str(src))
    failed = await daemon.engine.wait(view.id, timeout=120)
    assert failed.state == "failed"
    assert [t.state for t in failed.tasks] == ["done", "failed"]
    [body] = await bodies(daemon, ws.PATCH, view.id)
    assert (body["tasks"], body["files"]) == (["fix"], ["calc.py"])
    applied = await tool(daemon, "run_apply", {"run_id": view.id}, scope="command")
    assert applied.applied
    assert (src / "calc.py").read_text() == FIXED
    # a run whose every task failed has no patch: nothing to apply
    nothing = await daemon.engine.submit("tidy", plan={"tasks": [tidy]}, workspace=str(src))
    assert (await daemon.engine.wait(nothing.id, timeout=120)).state == "failed"
    assert await bodies(daemon, ws.PATCH, nothing.id) == []


async def test_a_workspace_needs_an_allowed_root_and_the_command_scope(
    tmp_path: Path, workspace_fleet: Make
) -> None:
    src = project(tmp_path / "src")
    other = project(tmp_path / "other")
    daemon, _ = await workspace_fleet([])
    with pytest.raises(Forbidden, match="workspace-root"):
        await daemon.engine.submit("Fix add in calc.py", lane="testing", workspace=str(other))
    with pytest.raises(Forbidden, match="command"):
        await tool(
            daemon,
            "submit",
            {"request": "Fix add in calc.py", "workspace": str(src)},
            scope="submit",
        )
    assert daemon.engine.list() == []


ESCAPES = """
set -u
echo pwned > {src}/calc.py 2>/dev/null && echo WROTE-USER-FILE
cat {src}/.env 2>/dev/null && echo READ-USER-ENV
cat .env 2>/dev/null && echo READ-VIEW-ENV
cat deploy.pem 2>/dev/null && echo READ-PEM
cat up 2>/dev/null && echo FOLLOWED-LINK
cat {outside} 2>/dev/null && echo READ-OUTSIDE
ln -s {outside} escape && cat escape 2>/dev/null && echo FOLLOWED-NEW-LINK
ls -a
echo changed > calc.py
"""


async def test_a_task_cannot_reach_the_users_files_hidden_files_or_links_out(
    tmp_path: Path, workspace_fleet: Make
) -> None:
    src = project(tmp_path / "src", repo=False)
    outside = tmp_path / "outside.txt"
    outside.write_text("outside secret\n")
    (src / "up").symlink_to("../../outside.txt")
    daemon, _ = await workspace_fleet([])
    script = ESCAPES.format(src=src, outside=outside)
    plan = {
        "tasks": [
            {
                "id": "probe",
                "lane": "backend",
                "instruction": "probe",
                "executor": "command",
                "argv": ["sh", "-c", script],
            },
            {
                "id": "after",
                "lane": "backend",
                "instruction": "see the probe's changes",
                "executor": "command",
                "argv": ["cat", "calc.py"],
                "needs": ["probe"],
            },
        ]
    }
    view = await daemon.engine.submit("probe the sandbox", plan=plan, workspace=str(src))
    done = await daemon.engine.wait(view.id, timeout=120)
    assert done.state == "done", done.error
    probe = done.task("probe")
    assert probe is not None
    assert probe.result is not None
    for marker in ("WROTE", "READ-", "FOLLOWED"):
        assert marker not in probe.result, probe.result
    listed = probe.result.split()
    assert {"calc.py", "test_calc.py"} <= set(listed)
    assert not {".env", "deploy.pem", "up"} & set(listed)
    assert (src / "calc.py").read_text() == BUGGY  # the user's directory is untouched
    after = done.task("after")
    assert after is not None
    assert after.result == "changed\n"  # it sees what it needs
    shown = await tool(daemon, "run_patch", {"run_id": view.id})
    assert "calc.py" in shown.files
    assert "escape" in shown.files  # the record says all it did; apply never writes a link
    with pytest.raises(Conflict, match="symlink"):
        await tool(daemon, "run_apply", {"run_id": view.id})
    assert (src / "calc.py").read_text() == BUGGY
    assert not (src / "escape").exists()


async def test_files_output_file_and_a_run_check_without_a_workspace(
    tmp_path: Path, workspace_fleet: Make
) -> None:
    """ "Write solution.py; run pytest": no workspace, an empty view, informed retry."""
    wrong = "Here it is:\n```python\ndef add(a, b):\n    return a - b\n```\n"
    right = "```python\n" + FIXED + "```\n"
    daemon, server = await workspace_fleet(
        [("assert -1 == 5", right, 0.0), ("Write add", wrong, 0.0)]
    )
    plan = {
        "tasks": [
            {
                "id": "solve",
                "lane": "backend",
                "instruction": "Write add(a, b) in solution.py",
                "files": {
                    "test_solution.py": "from solution import add\n\n\ndef test_add():\n"
                    "    assert add(2, 3) == 5\n"
                },
                "output_file": "solution.py",
                "assertions": [
                    {
                        "type": "run",
                        "argv": [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
                        "timeout_s": 60,
                    }
                ],
            }
        ]
    }
    with pytest.raises(Forbidden, match="run checks"):
        await tool(daemon, "submit", {"request": "add", "plan": plan}, scope="submit")
    view = await daemon.engine.submit("Write add", plan=plan)
    done = await daemon.engine.wait(view.id, timeout=120)
    assert done.state == "done", done.error
    assert done.tasks[0].attempts == 2
    runs = await bodies(daemon, ws.CHECK_RUN, view.id)
    assert [(r["exit_code"], r["source"]) for r in runs] == [(1, "task"), (0, "task")]
    assert "assert -1 == 5" in runs[0]["stdout_tail"]
    assert "Write add(a, b) in solution.py" in user_texts(server)[0]
    assert await bodies(daemon, ws.PATCH, view.id) == []  # no workspace: nothing to apply
    assert json.dumps(done.model_dump())  # the view stays plain JSON


async def test_the_cli_submits_on_a_workspace_then_prints_and_applies_the_patch(
    tmp_path: Path,
    workspace_fleet: Make,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`tally submit --workspace DIR --file F -` (stdin), `tally patch`, `tally apply`."""
    import asyncio
    import io

    from aiohttp import web

    from surfaces.cli import main
    from surfaces.http import HttpOptions, create_app

    src = project(tmp_path / "src")
    trace = tmp_path / "trace.txt"
    trace.write_text("AssertionError: add(2, 3) returned -1\n")
    daemon, server = await workspace_fleet([("Fix add", RIGHT, 0.0)])
    sock = tmp_path / "sock" / "tally.sock"
    sock.parent.mkdir()
    runner = web.AppRunner(create_app(daemon, HttpOptions(keepalive_s=0.2)))
    await runner.setup()
    await web.UnixSite(runner, str(sock)).start()
    at = ["--socket", str(sock)]
    try:
        monkeypatch.setattr("sys.stdin", io.StringIO("Fix add in calc.py so the tests pass\n"))
        argv = ["submit", "-", "--workspace", str(src), "--lane", "testing", "--file", str(trace)]
        assert await asyncio.to_thread(main, [*argv, *at]) == 0
        out = capsys.readouterr()
        [run] = daemon.engine.list()
        assert f"`tally apply {run.id}`" in out.err
        prompt = user_texts(server)[0]
        assert prompt.startswith("Fix add in calc.py so the tests pass")  # stdin, not "-"
        assert f"File {trace}:" in prompt
        assert "returned -1" in prompt
        assert await asyncio.to_thread(main, ["patch", run.id, *at]) == 0
        shown = capsys.readouterr().out
        assert shown.startswith("diff --git a/calc.py b/calc.py")
        assert (src / "calc.py").read_text() == BUGGY
        assert await asyncio.to_thread(main, ["apply", run.id, "--check", *at]) == 0
        assert "the patch applies" in capsys.readouterr().out
        assert (src / "calc.py").read_text() == BUGGY
        assert await asyncio.to_thread(main, ["apply", run.id, *at]) == 0
        assert "applied to" in capsys.readouterr().out
        assert (src / "calc.py").read_text() == FIXED
        assert await asyncio.to_thread(main, ["apply", run.id, *at]) == 0
        assert "already applied" in capsys.readouterr().out
        (src / "calc.py").write_text("def add(a, b):\n    return 0\n")
        assert await asyncio.to_thread(main, ["apply", run.id, *at]) == 1
        err = capsys.readouterr().err
        assert "changed since the run's snapshot: calc.py" in err
        assert "Traceback" not in err
        assert await asyncio.to_thread(main, ["submit", "say hello", *at]) == 0
        capsys.readouterr()
        [plain] = [r for r in daemon.engine.list() if r.id != run.id]
        assert await asyncio.to_thread(main, ["patch", plain.id, *at]) == 1
        err = capsys.readouterr().err  # no "yet": a run without a workspace never gets one
        assert f"run {plain.id} worked on no workspace (`--workspace DIR`)" in err
        outside = project(tmp_path / "elsewhere")
        argv = ["submit", "Fix add in calc.py", "--workspace", str(outside)]
        assert await asyncio.to_thread(main, [*argv, *at]) == 1
        assert "--workspace-root" in capsys.readouterr().err
        link = tmp_path / "src" / "shortcut"  # inside the root, leading out of it
        link.symlink_to(outside)
        argv = ["submit", "Fix add in calc.py", "--workspace", str(link)]
        assert await asyncio.to_thread(main, [*argv, *at]) == 1
        err = capsys.readouterr().err
        assert f"workspace '{link}' ({outside.resolve()}) is not inside an allowed root" in err
    finally:
        await runner.cleanup()


async def test_a_resumed_workspace_run_takes_its_snapshot_again_and_checks_it(
    tmp_path: Path,
) -> None:
    """After a restart the copies are gone: a resumed run copies the workspace again, and goes
    on only if its visible files are the ones witnessed at submit."""
    import asyncio

    src = project(tmp_path / "src")
    server = ScriptedServer([("Fix add", RIGHT, 60.0)])
    await server.start()
    settings = settings_for(
        tmp_path, roster_toml(server.url, lanes=LANES), workspace_roots=(tmp_path / "src",)
    )
    ask = "Fix add in calc.py so the tests pass"

    async def interrupted() -> str:
        first = Daemon(settings)
        await first.start()
        try:
            view = await first.engine.submit(ask, lane="testing", workspace=str(src))
            for _ in range(400):
                if server.in_flight():
                    break
                await asyncio.sleep(0.05)
            assert server.in_flight() == 1
        finally:
            await first.stop()
        return view.id

    try:
        same, changed = await interrupted(), await interrupted()
        server.rules = [("Fix add", RIGHT, 0.0)]
        second = Daemon(settings)
        await second.start()
        try:
            assert second.engine.get(same).state == "interrupted"
            await second.engine.resume(same)
            done = await second.engine.wait(same, timeout=120)
            assert done.state == "done", done.error
            assert done.patch_files == ["calc.py"]
            (src / "README.md").write_text("a file the snapshot did not have\n")
            await second.engine.resume(changed)
            failed = await second.engine.wait(changed, timeout=120)
            assert failed.state == "failed"
            assert "changed since the run's snapshot" in (failed.error or "")
            assert (src / "calc.py").read_text() == BUGGY
        finally:
            await second.stop()
    finally:
        await server.stop()


async def test_the_prompt_fits_the_context_window_and_says_what_it_cut(
    tmp_path: Path, workspace_fleet: Make
) -> None:
    """The member's n_ctx (4096, from /props) bounds what of the workspace goes in the prompt;
    an answer in prose changes nothing and is no failure."""
    src = project(tmp_path / "src", repo=False)
    big = "".join(f"LINE_{i} = {i}\n" for i in range(3000))
    (src / "big.py").write_text(big)
    daemon, server = await workspace_fleet([("Explain big.py", "It defines constants.", 0.0)])
    view = await daemon.engine.submit(
        "Explain big.py and calc.py", lane="backend", workspace=str(src)
    )
    done = await daemon.engine.wait(view.id, timeout=60)
    assert done.state == "done", done.error
    (prompt,) = user_texts(server)
    assert len(prompt) < (4096 - 512) * 3  # the window less the answer's tokens
    assert "big.py (cut: its first" in prompt
    assert f"of {len(big)} characters, to fit the context window" in prompt
    assert "Not shown for lack of room in the context window: calc.py" in prompt
    assert "LINE_0 = 0" in prompt
    assert "LINE_2999" not in prompt
    assert done.patch_files == []
