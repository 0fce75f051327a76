"""The agent loop end to end: a scripted model drives real tools on a real project directory,
`run` and the checks in real bubblewrap, every step witnessed in a real ledger and replayed.
Each scenario runs in both modes: native `tool_calls` and schema-constrained JSON."""

from __future__ import annotations

import hashlib
import itertools
import json
import time
from typing import Any

import pytest

from daemon.runs.agent import AgentLimits
from daemon.runs.agent.calls import from_native, from_text, response_format, tool_specs
from daemon.slots.chat import ChatClient
from tests.agent.conftest import TEST_ARGV, Make, needs_bwrap
from tests.agent.model import Raw, Step

pytestmark = needs_bwrap
MODES = pytest.mark.parametrize("mode", ["native", "json"])

WRONG = {"path": "calc.py", "old": "return a - b", "new": "return a + b + 1"}
FIX = {"path": "calc.py", "old": "return a + b + 1", "new": "return a + b"}


def observations(steps: list[dict[str, Any]]) -> list[str]:
    return [s["observation"] for s in steps]


@MODES
async def test_a_scripted_model_fixes_the_project_step_by_step(bench: Make, mode: str) -> None:
    script = [
        Step("list_files"),
        Step("read_file", {"path": "calc.py"}),
        Step("edit", WRONG),
        Step("run", {"argv": TEST_ARGV}),
        Step("edit", FIX),
        Step("run", {"argv": TEST_ARGV}),
        Step("finish", {"summary": "add adds"}),
    ]
    b = await bench(script)
    result = await b.go(mode, checks=b.checks)
    assert (result.outcome, result.summary, result.steps, result.mode) == (
        "finished",
        "add adds",
        7,
        mode,
    )
    assert (
        b.view / "calc.py"
    ).read_text() == "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n"

    steps = await b.steps()
    assert [s["step"] for s in steps] == list(range(1, 8))
    assert [s["tool"] for s in steps] == [
        "list_files", "read_file", "edit", "run", "edit", "run", "finish",
    ]  # fmt: skip
    assert [s["outcome"] for s in steps] == ["ok", "ok", "ok", "error", "ok", "ok", "finished"]
    assert {s["mode"] for s in steps} == {mode}
    assert {s["parse"] for s in steps} == {"native" if mode == "native" else "parsed"}
    assert steps[2]["arguments"] == WRONG
    listing, read, _, failed, _, passed, finished = observations(steps)
    assert "calc.py (" in listing
    assert "test_calc.py (" in listing
    assert "return a - b" in read
    assert "lines 1-6 of 6" in read
    assert "exit code 1" in failed
    assert "add(2, 3) gave 6" in failed
    assert "exit code 0" in passed
    assert "all tests pass" in passed
    assert "the checks pass" in finished
    for s in steps:
        assert s["observation_sha256"] == hashlib.sha256(s["observation"].encode()).hexdigest()
        assert s["tokens"]["prompt"] > 0
        assert s["tokens"]["completion"] > 0
        assert s["timings"]["model_us"] > 0
        assert s["timings"]["step_us"] >= s["timings"]["model_us"] + s["timings"]["tool_us"]
        assert s["timings"]["server"]["prompt_us"] == 1500
        assert (s["member"], s["task"]) == ("tiny", "t1")
    assert steps[3]["timings"]["tool_us"] > steps[1]["timings"]["tool_us"]  # a sandbox ran
    assert len({s["slot"] for s in steps}) == 1, "every step on the same slot (affinity)"

    # The prefix is stable: each request is the previous one with the last step appended,
    # so the slot's cache serves all but the new tokens.
    chats = b.server.chats
    assert len(chats) == 7
    for before, after in itertools.pairwise(chats):
        assert after["messages"][: len(before["messages"])] == before["messages"]
        assert len(after["messages"]) == len(before["messages"]) + 2
        assert after["cache_prompt"] is True
        assert after["id_slot"] == before["id_slot"]
    for s in steps[2:]:
        assert s["tokens"]["cached"] / s["tokens"]["prompt"] >= 0.8
    if mode == "native":
        assert {t["function"]["name"] for t in chats[0]["tools"]} == {
            "list_files", "read_file", "search", "write_file", "edit", "run", "finish",
        }  # fmt: skip
        assert "response_format" not in chats[0]
        assert chats[1]["messages"][-1]["role"] == "tool"
    else:
        schema = chats[0]["response_format"]["json_schema"]["schema"]
        assert len(schema["oneOf"]) == 7
        assert "tools" not in chats[0]
        assert chats[1]["messages"][-1]["content"].startswith("[list_files result]")

    # Replay rebuilds the task's steps and what they cost from the record alone.
    view = await b.replayed()
    task = view.task("t1")
    assert task is not None
    assert (task.steps, task.last_tool, task.member) == (7, "finish", "tiny")
    assert view.spent.model_calls == 7
    assert view.spent.tokens == sum(
        s["tokens"]["prompt"] + s["tokens"]["completion"] for s in steps
    )


@MODES
async def test_a_malformed_call_is_rescued_and_a_hopeless_one_nudged(
    bench: Make, mode: str
) -> None:
    script = [
        Raw("Sure:\n```json\n{'tool': 'read_file', 'arguments': {'path': 'calc.py',},}\n```"),
        Raw("I think I will now look at the tests."),
        Raw('{"tool": "read_file", "arguments": {"path": "test_calc.py"'),
        Raw('{"tool": "edit", "arguments": {"path": "calc.py"}}'),
        Step("finish", {"summary": "looked"}),
    ]
    b = await bench(script)
    result = await b.go(mode)
    assert (result.outcome, result.steps) == ("finished", 5)
    steps = await b.steps()
    assert [(s["tool"], s["parse"], s["outcome"]) for s in steps] == [
        ("read_file", "repaired", "ok"),
        (None, "malformed", "malformed"),
        ("read_file", "repaired", "ok"),
        (None, "malformed", "malformed"),
        ("finish", "native" if mode == "native" else "parsed", "finished"),
    ]
    assert "return a - b" in steps[0]["observation"]
    assert "holds no JSON object" in steps[1]["observation"]
    assert "old: Field required" in steps[3]["observation"]
    assert steps[1]["reply"] == "I think I will now look at the tests."  # what it said
    # the nudge is what the model sees next, after its own malformed reply
    chats = b.server.chats
    said = "I think I will now look at the tests."
    assert chats[2]["messages"][-2] == {"role": "assistant", "content": said}
    assert chats[2]["messages"][-1]["content"].startswith("Your reply was not a valid tool call")


@MODES
async def test_malformed_replies_end_the_loop_after_the_nudges(bench: Make, mode: str) -> None:
    b = await bench([Raw("no idea")])
    result = await b.go(mode, limits=AgentLimits(nudges=2, max_steps=10))
    assert (result.outcome, result.steps) == ("malformed", 3)
    assert result.error is not None
    assert "3 malformed replies in a row" in result.error


@MODES
async def test_the_same_call_three_times_ends_as_stuck(bench: Make, mode: str) -> None:
    script = [
        Step("read_file", {"path": "calc.py"}),
        Step("write_file", {"path": "notes.txt", "content": "x"}),
        Step("read_file", {"path": "calc.py"}),  # after a write: not a repeat
        Step("read_file", {"path": "calc.py"}),
        Step("read_file", {"path": "calc.py"}),
        Step("finish", {"summary": "never reached"}),
    ]
    b = await bench(script)
    result = await b.go(mode)
    assert (result.outcome, result.steps) == ("stuck", 5)
    steps = await b.steps()
    assert [s["outcome"] for s in steps] == ["ok", "ok", "ok", "ok", "stuck"]
    assert "3 times with nothing changed" in steps[-1]["observation"]
    assert result.last_seq is not None
    assert b.server.served == 5


@MODES
async def test_a_write_that_changes_nothing_is_no_progress(bench: Make, mode: str) -> None:
    b = await bench([Step("write_file", {"path": "hello.txt", "content": "hi"})])
    result = await b.go(mode)
    # the first write changed the view; the next three changed nothing: stuck on the third
    assert (result.outcome, result.steps) == ("stuck", 4)
    said = [s["observation"] for s in await b.steps()]
    assert said[0] == "wrote hello.txt (2 bytes)"
    assert said[1] == "hello.txt already holds exactly this content (2 bytes): nothing changed"


@MODES
async def test_finish_is_refused_while_the_checks_fail(bench: Make, mode: str) -> None:
    script = [
        Step("finish", {"summary": "done already"}),
        Step("edit", {"path": "calc.py", "old": "return a - b", "new": "return a + b"}),
        Step("finish", {"summary": "fixed add"}),
    ]
    b = await bench(script)
    result = await b.go(mode, checks=b.checks)
    assert (result.outcome, result.summary) == ("finished", "fixed add")
    steps = await b.steps()
    assert [s["outcome"] for s in steps] == ["finish_refused", "ok", "finished"]
    assert "finish refused" in steps[0]["observation"]
    assert "add(2, 3) gave -1" in steps[0]["observation"]  # the checks' own output
    assert b.server.chats[1]["messages"][-1]["content"].endswith(
        steps[0]["observation"].split("\n", 1)[1]
    )


@MODES
async def test_compaction_keeps_a_small_context(bench: Make, mode: str) -> None:
    n_ctx = 3000
    script: list[Step | Raw] = [Step("read_file", {"path": f"notes{i}.txt"}) for i in range(6)]
    script.append(Step("finish", {"summary": "read them all"}))
    b = await bench(script, n_ctx=n_ctx)
    for i in range(6):
        (b.view / f"notes{i}.txt").write_text(f"note {i}: " + "lorem ipsum dolor " * 100)
    limits = AgentLimits(n_ctx=n_ctx, step_tokens=200, keep_last=2, max_steps=10)
    result = await b.go(mode, limits=limits)
    assert result.outcome == "finished", result.error
    steps = await b.steps()
    assert sum(s["compacted"] for s in steps) >= 3
    system, task = b.server.chats[0]["messages"][:2]
    for chat in b.server.chats:
        messages = chat["messages"]
        assert messages[:2] == [system, task], "the system prompt and the task are never cut"
        size = len(json.dumps(messages)) / 3.5 + len(json.dumps(chat.get("tools", []))) / 3.5
        assert size + 200 < n_ctx
    seen = [str(m.get("content")) for chat in b.server.chats for m in chat["messages"]]
    assert any("[cut to save context: the read_file result of step 1," in c for c in seen)
    last = b.server.chats[-1]["messages"]
    shown = [m["content"] for m in last[2:] if m["role"] != "assistant"]
    assert "note 5:" in shown[-1], "the last steps are never cut"
    assert "note 4:" in shown[-2]
    if "no longer shown" in shown[0]:  # a long loop's oldest steps go whole, noted once
        assert shown[0].startswith("[cut to save context: steps 1-")
        assert sum("no longer shown" in c for c in shown) == 1


async def test_a_context_too_small_for_the_task_ends_the_loop(bench: Make) -> None:
    b = await bench([Step("finish", {"summary": "x"})])
    result = await b.go("json", instruction="do " * 3000, limits=AgentLimits(n_ctx=1024))
    assert result.outcome == "context"
    assert result.steps == 0
    assert b.server.chats == []


async def test_a_server_without_native_tools_falls_back_to_json(bench: Make) -> None:
    b = await bench([Step("read_file", {"path": "calc.py"}), Step("finish", {"summary": "ok"})])
    b.server.refuse_tools = True
    result = await b.go("native")
    assert (result.outcome, result.mode) == ("finished", "json")
    assert [s["mode"] for s in await b.steps()] == ["json", "json"]
    assert all("response_format" in c and "tools" not in c for c in b.server.chats)


async def test_budgets_end_the_loop(bench: Make) -> None:
    """Steps, tokens and wall time each end the loop with their own outcome; the run's
    budget (`reserve`) raises through it, as for any model call."""
    read = Step("read_file", {"path": "calc.py", "start_line": 1})
    other = Step("read_file", {"path": "calc.py", "start_line": 2})
    b = await bench([read, other, read, other])
    result = await b.go("json", limits=AgentLimits(max_steps=3))
    assert (result.outcome, result.steps) == ("steps", 3)

    b = await bench([read, other, read, other])
    result = await b.go("json", limits=AgentLimits(tokens=400))
    assert result.outcome == "tokens"
    assert result.tokens >= 400
    assert result.steps == 2

    sleep = Step("run", {"argv": ["sleep", "30"]})
    b = await bench([sleep])
    started = time.monotonic()
    result = await b.go("json", limits=AgentLimits(wall_s=1.5))
    assert result.outcome == "wall"
    assert time.monotonic() - started < 5, "the sandboxed sleep was killed at the deadline"

    class Exhausted(Exception):
        pass

    calls = 0

    def reserve() -> None:
        nonlocal calls
        calls += 1
        if calls > 2:
            raise Exhausted

    b = await bench([read, other, read])
    with pytest.raises(Exhausted):
        await b.go("json", reserve=reserve)
    assert len(await b.steps()) == 2


@MODES
async def test_streamed_tool_calls_are_read_whole(bench: Make, mode: str) -> None:
    """A server tally spawns is always streamed: tool calls arrive in pieces and are joined."""
    b = await bench([Step("edit", WRONG)])
    client = ChatClient()
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "x"}], "stream": True}
    body |= {"tools": tool_specs()} if mode == "native" else {"response_format": response_format()}
    try:
        done = await client.complete(b.server.url + "/chat/completions", body)
    finally:
        await client.close()
    call = from_native(done.tool_calls, done.text) if mode == "native" else from_text(done.text)
    assert (call.tool, call.arguments) == ("edit", WRONG)
