"""The `agent` executor as a run uses it, through the real Daemon: a plan's agent task leases a
slot, acts on the run's workspace view (real git, real bubblewrap), has its `finish` refused
while the task's check fails, and its changes become the run's patch; its steps are in the
record, in `tally run`'s lines, in the SSE stream (bounded) and in MCP progress.

The model is the scripted tool-calling fake (`tests.agent.model.ToolServer`) behind the pool."""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client

from daemon import record as rec
from daemon.clients import Client
from daemon.plans import PlanInvalid
from daemon.runs import entries as k
from daemon.runs.agent.record import EVENT_CHARS
from daemon.service import Daemon
from daemon.tools import TOOLS
from daemon.tools.progress import ProgressSteps
from daemon.tools.tool import ToolContext
from daemon.workspace import record as ws
from surfaces.cli.stream import attempt_lines, step_line
from surfaces.http import HttpOptions, create_app
from tests.agent.model import Raw, Script, Step, ToolServer
from tests.runs.model_server import roster_toml, settings_for
from tests.workspace.repo import FIXED, project

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")

ROOT = Path(__file__).resolve().parents[2]
CHECK = [sys.executable, "-B", "-c", "import calc, sys; sys.exit(calc.add(2, 3) != 5)"]
LANES = f"""[[lanes]]
name = "testing"
keywords = ["testing"]
tier = "cheap"
system = "You fix code so its tests pass."
agent = "json"
checks = [{{ type = "run", argv = {json.dumps(CHECK)}, timeout_s = 30 }}]

[[lanes]]
name = "backend"
keywords = ["backend"]
tier = "cheap"
system = "You do backend work."
"""
WRONG = {"path": "calc.py", "old": "return a - b", "new": "return a * b"}
FIX = {"path": "calc.py", "old": "return a * b", "new": "return a + b"}
HOSTILE = "<img src=x onerror=alert(1)>\x1b[31m" + "x" * 5000
SCRIPT: Script = [
    Step("list_files"),
    Step("read_file", {"path": "calc.py"}),
    Step("edit", WRONG),
    Step("finish", {"summary": "done?"}),  # refused: the check fails
    Step("edit", FIX),
    Step("run", {"argv": CHECK}),
    Step("write_file", {"path": "NOTES.md", "content": HOSTILE}),
    Step("finish", {"summary": "add adds"}),
]
OUTCOMES = ["ok", "ok", "ok", "finish_refused", "ok", "ok", "ok", "finished"]


def agent_plan(**task: Any) -> dict[str, Any]:
    one = {"id": "t1", "lane": "backend", "instruction": "Fix add in calc.py", "executor": "agent"}
    return {"tasks": [one | {"assertions": [{"type": "run", "argv": CHECK}]} | task]}


Make = Callable[..., Any]


@pytest.fixture
async def fleet(tmp_path: Path) -> AsyncIterator[Make]:
    made: list[tuple[Daemon, ToolServer]] = []

    async def make(script: Script, **policy: Any) -> tuple[Daemon, ToolServer, Path]:
        server = ToolServer(script)
        await server.start()
        where = tmp_path / f"d{len(made)}"
        src = project(where / "src")
        roster = roster_toml(server.url, lanes=LANES, **policy)
        daemon = Daemon(settings_for(where, roster, workspace_roots=(where / "src",)))
        await daemon.start()
        made.append((daemon, server))
        return daemon, server, src

    yield make
    for daemon, server in made:
        await daemon.stop()
        await server.stop()


async def bodies(daemon: Daemon, kind: str, run: str) -> list[tuple[int, int | None, Any]]:
    found = await daemon.ledger.entries(start=0, limit=10_000, kind=kind, run=run)
    return [(e.seq, e.parent, (await daemon.ledger.body(e.body)).value) for e in found]


async def tool(daemon: Daemon, name: str, args: dict[str, Any], scope: str = "admin") -> Any:
    spec = TOOLS[name]
    ctx = ToolContext(client=Client(name="tester", scope=scope))  # type: ignore[arg-type]
    return await spec.handler(daemon, spec.input.model_validate(args), ctx)


async def test_an_agent_task_fixes_the_bug_in_a_workspace_run(fleet: Make) -> None:
    daemon, server, src = await fleet(SCRIPT)
    view = await daemon.engine.submit(
        "Fix add", plan=agent_plan(), workspace=str(src), budget={"model_calls": 20}
    )
    done = await daemon.engine.wait(view.id, timeout=120)
    assert done.state == "done", done.error
    task = done.tasks[0]
    assert (task.executor, task.attempts, task.steps, task.last_tool) == ("agent", 1, 8, "finish")
    assert done.spent.model_calls == 8  # each step is a metered model call
    assert (src / "calc.py").read_text() != FIXED  # the user's files wait for `apply`

    ((start_seq, _, start),) = await bodies(daemon, k.TASK_START, view.id)
    assert start["executor"] == "agent"
    assert start["tier"] == "cheap"
    steps = await bodies(daemon, k.AGENT_STEP, view.id)
    assert [b["outcome"] for _, _, b in steps] == OUTCOMES
    assert [b["tool"] for _, _, b in steps] == [s.tool for s in SCRIPT if isinstance(s, Step)]
    # a chain: task.start -> step 1 -> step 2 -> ..., each step naming its task and slot
    assert [p for _, p, _ in steps] == [start_seq] + [s for s, _, _ in steps[:-1]]
    assert all(b["task"] == "t1" and b["mode"] == "json" for _, _, b in steps)
    assert "finish refused" in steps[3][2]["observation"]
    assert "exit 1" in steps[3][2]["observation"]  # the failing check's output, shown
    # the same slot step after step (the prompt cache stays warm), json mode asked each time
    chats = server.chats
    assert len(chats) == 8
    assert len({c.get("id_slot") for c in chats}) == 1
    assert all(c["response_format"]["type"] == "json_schema" for c in chats)
    assert chats[0]["messages"][0]["content"].startswith("You do backend work.")
    # the result is the finish summary and hangs off the last step; the diff and checks follow
    ((_, result_parent, result),) = await bodies(daemon, k.TASK_RESULT, view.id)
    assert (result["output"], result["ok"], result_parent) == ("add adds", True, steps[-1][0])
    ((_, _, diff),) = await bodies(daemon, ws.TASK_DIFF, view.id)
    assert sorted(diff["files"]) == ["NOTES.md", "calc.py"]
    assert "+    return a + b" in diff["diff"]
    checks = await bodies(daemon, ws.CHECK_RUN, view.id)
    assert [b["exit_code"] for _, _, b in checks] == [0]
    patch = (await tool(daemon, "run_patch", {"run_id": view.id})).model_dump()
    assert "+    return a + b" in patch["patch"]

    # `tally run ID`: a line per step (tool, arguments, outcome, seq), the model's text tamed
    page = (await tool(daemon, "ledger_entries", {"run": view.id, "bodies": True})).model_dump()
    lines = attempt_lines(page["entries"])["t1"]
    stepped = [line for line in lines if line.lstrip().startswith("step ")]
    assert len(stepped) == 8
    assert stepped[1].lstrip().startswith("step 2 read_file(path=calc.py) → ok: ")
    assert f"[seq {steps[1][0]}]" in stepped[1]
    assert "\x1b" not in "".join(stepped)
    assert "\\u001b" in stepped[6]
    assert all(len(line) < 600 for line in stepped)

    # replay rebuilds the steps from the record, no model call
    replayed = (await tool(daemon, "run_replay", {"run_id": view.id})).model_dump()
    assert replayed["tasks"][0]["steps"] == 8


async def test_the_event_stream_and_mcp_progress_show_each_step(
    fleet: Make, tmp_path: Path
) -> None:
    daemon, _, src = await fleet(SCRIPT)
    sock = tmp_path / "sock" / "tally.sock"
    sock.parent.mkdir()
    runner = web.AppRunner(create_app(daemon, HttpOptions(keepalive_s=0.2)))
    await runner.setup()
    await web.UnixSite(runner, str(sock)).start()
    seen: list[str] = []

    async def on_progress(progress: float, total: float | None, message: str | None) -> None:
        seen.append(message or "")

    try:
        params = StdioServerParameters(
            command=sys.executable,
            args=["-m", "surfaces", "mcp"],
            env={"TALLY_SOCKET": str(sock)},
            cwd=str(ROOT),
        )
        async with (
            stdio_client(params) as (read, write),
            ClientSession(read, write) as session,
        ):
            await session.initialize()
            args = {
                "request": "Fix add",
                "plan": agent_plan(),
                "workspace": str(src),
                "wait": True,
                "timeout_s": 120,
            }
            result = await session.call_tool("submit", args, progress_callback=on_progress)
        assert not result.is_error, result.content
        run = result.structured_content
        assert run is not None
        assert run["state"] == "done", run
        stepped = [m for m in seen if " step " in m]
        assert "t1 step 2: read_file(path=calc.py) → ok" in stepped, seen
        assert any(m.startswith("t1 step 4: finish(") and "finish_refused" in m for m in stepped)
        assert all(len(m) <= 240 for m in seen)

        # SSE: every step as an `agent.step` event with its seq, its texts cut to EVENT_CHARS
        connector = aiohttp.UnixConnector(path=str(sock))
        async with (
            aiohttp.ClientSession(connector=connector) as http,
            http.get(f"http://tally/v1/runs/{run['id']}/events") as resp,
        ):
            text = (await resp.read()).decode()
    finally:
        await runner.cleanup()
    events = []
    for frame in text.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in frame.splitlines() if ": " in line)
        if fields.get("event") == k.AGENT_STEP:
            events.append((int(fields["id"]), json.loads(fields["data"])))
    assert [d["step"] for _, d in events] == list(range(1, 9))
    written = events[6][1]
    assert written["clipped"] is True
    assert len(written["arguments"]["content"]) == EVENT_CHARS
    assert all(len(d["observation"]) <= EVENT_CHARS for _, d in events)
    whole = await daemon.ledger.body((await daemon.ledger.get(events[6][0])).body)
    assert whole.value["arguments"]["content"] == HOSTILE  # the record keeps it whole


async def test_a_stuck_agent_fails_its_attempt_and_the_next_is_told_why(fleet: Make) -> None:
    daemon, server, src = await fleet([Step("read_file", {"path": "calc.py"})])
    view = await daemon.engine.submit(
        "Fix add", plan=agent_plan(max_steps=5), workspace=str(src), budget={"model_calls": 20}
    )
    done = await daemon.engine.wait(view.id, timeout=120)
    assert done.state == "failed"
    results = await bodies(daemon, k.TASK_RESULT, view.id)
    steps = await bodies(daemon, k.AGENT_STEP, view.id)
    starts = await bodies(daemon, k.TASK_START, view.id)
    assert len(results) == len(starts) >= 2  # retried, then climbed: each attempt a loop
    first = results[0]
    assert first[2]["ok"] is False
    assert "the agent stopped (stuck) after 3 steps" in first[2]["error"]
    assert first[1] == steps[2][0]  # the failed result hangs off its last step
    assert steps[2][2]["outcome"] == "stuck"
    assert any("the agent stopped (stuck)" in f for f in starts[1][2]["feedback"])
    # informed retry: the next attempt's task message carries the failure
    second = server.chats[3]["messages"][1]["content"]
    assert "the agent stopped (stuck)" in second
    assert {s[2]["task"] for s in steps} == {"t1"}
    assert max(s[2]["step"] for s in steps) == 3  # each attempt's steps count from 1


async def test_a_lane_with_agent_on_makes_tallys_own_plan_an_agent_task(fleet: Make) -> None:
    daemon, _, src = await fleet(
        [Step("edit", {**FIX, "old": "return a - b"}), Step("finish", {"summary": "ok"})]
    )
    view = await daemon.engine.submit("Fix add", lane="testing", workspace=str(src))
    done = await daemon.engine.wait(view.id, timeout=120)
    assert done.state == "done", done.error
    assert done.plan is not None
    assert done.plan["tasks"][0]["executor"] == "agent"
    assert done.tasks[0].steps == 2
    checks = await bodies(daemon, ws.CHECK_RUN, view.id)
    assert [(b["source"], b["exit_code"]) for _, _, b in checks] == [("lane", 0)]
    # without a workspace the same lane's tasks stay chat tasks (nothing to act on)
    plain = await daemon.engine.submit("Fix add", lane="testing")
    ended = await daemon.engine.wait(plain.id, timeout=60)
    assert ended.plan is not None
    assert ended.plan["tasks"][0]["executor"] == "chat"


async def test_hostile_plans_are_refused_with_the_task_and_what_to_do(fleet: Make) -> None:
    daemon, server, _src = await fleet([Raw("never asked")])
    with pytest.raises(PlanInvalid) as refused:
        await daemon.engine.submit("x", plan=agent_plan())  # no workspace, no files
    (problem,) = refused.value.problems
    assert problem.code == "executor"
    assert problem.tasks == ["t1"]
    assert "workspace" in problem.message
    assert "tally submit --workspace" in problem.message

    unknown = {"tasks": [{"id": "t1", "lane": "backend", "instruction": "x", "executor": "robot"}]}
    with pytest.raises(PlanInvalid) as bad:
        await tool(daemon, "plan", {"plan": unknown})
    assert any("executor" in p.message and "agent" in p.message for p in bad.value.problems)
    found = await _plan(daemon, agent_plan(output_file="out.txt"))
    ((code, message),) = found
    assert code == "executor"
    assert message.startswith("tasks[0]: an agent task edits the files itself")
    assert "drop `output_file`" in message
    chat_steps = {"tasks": [{"id": "c", "lane": "backend", "instruction": "x", "max_steps": 3}]}
    assert [c for c, _ in await _plan(daemon, chat_steps)] == ["executor"]
    assert [c for c, _ in await _plan(daemon, agent_plan(argv=["ls"]))] == ["executor"]
    with pytest.raises(PlanInvalid):
        await tool(daemon, "plan", {"plan": agent_plan(max_steps=10_000)})
    # an agent needs `command` scope: it runs commands in the sandbox
    files = agent_plan(files={"calc.py": "def add(a, b):\n    return a - b\n"})
    with pytest.raises(Exception, match="command"):
        await tool(daemon, "submit", {"request": "x", "plan": files}, scope="submit")
    assert server.chats == []  # nothing refused reached the model


async def _plan(daemon: Daemon, plan: dict[str, Any]) -> list[tuple[str, str]]:
    out = await tool(daemon, "plan", {"plan": plan})
    return [(p.code, p.message) for p in out.problems]


def test_progress_and_step_lines_are_bounded_and_tame() -> None:
    body = {
        "task": "t1\x1b[2J",
        "step": 3,
        "tool": "edit",
        "arguments": {"path": "a\u202eb.py", "old": "x" * 10_000, "new": "\x07"},
        "outcome": "error",
        "observation": "\x1b]0;pwned\x07" + "y" * 10_000,
        "tokens": {"prompt": 10, "completion": 2, "cached": 8},
        "timings": {"step_us": 12_000},
    }
    whole = {"mode": "json", "parse": "parsed", "reply": "", "observation_sha256": "0" * 64,
             "member": "m", "instance": 0, "slot": 0}  # fmt: skip
    line = step_line(rec.AgentStep.read(body | whole))
    assert len(line) < 500
    assert "\x1b" not in line
    assert "\u202e" not in line
    assert "\x07" not in line
    assert line.startswith("step 3 edit(path=a\\u202eb.py, old=xxx")
    assert line.endswith("10+2 tok (8 cached), 12 ms")
    _, _, message = ProgressSteps().agent_step(body)
    assert len(message) <= 240
    assert message.startswith("t1")
