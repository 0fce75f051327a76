"""The engine over in-memory fakes: the whole control loop, witnessed."""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

import pytest

from daemon.errors import Conflict
from daemon.runs import entries as k
from daemon.runs.engine import Engine, EngineOptions
from daemon.runs.replay import replay
from tests.runs.fakes import KeywordRouter, MemoryLedger, ScriptedPool, make_roster


def user_text(messages: list[dict[str, Any]]) -> str:
    return "\n".join(str(m["content"]) for m in messages if m["role"] == "user")


def make_engine(script: Any, options: EngineOptions | None = None, **policy: Any):
    roster = make_roster(**policy)
    ledger = MemoryLedger()
    pool = ScriptedPool(roster, script)
    engine = Engine(ledger, pool, roster, KeywordRouter(roster), options=options)
    return engine, ledger, pool


PRINT_ARGV = "import json, sys; print(json.dumps(sys.argv[1:]))"

DAG = {
    "tasks": [
        {"id": "api", "lane": "backend", "instruction": "Design the API."},
        {"id": "doc", "lane": "docs", "instruction": "Document it.", "needs": ["api"]},
        {"id": "test", "lane": "testing", "instruction": "Test it.", "needs": ["api"]},
    ]
}


def dag_script(member: str, messages: list[dict[str, Any]]) -> str:
    text = user_text(messages)
    if "Combine" in str(messages[0]["content"]):
        return "FINAL ANSWER about the api, docs and tests"
    if "Design the API" in text:
        return "GET /items"
    if "Document it" in text:
        assert "GET /items" in text  # upstream results reach dependants
        return "docs for GET /items"
    return "tests for GET /items"


async def test_three_task_dag_answers_with_a_causal_chain() -> None:
    engine, ledger, pool = make_engine(dag_script)
    view = await engine.submit("build an api with docs", plan=DAG)
    done = await engine.wait(view.id, timeout=5)
    assert done.state == "done", done.error
    assert done.answer == "FINAL ANSWER about the api, docs and tests"
    assert [t.state for t in done.tasks] == ["done", "done", "done"]
    assert done.spent.model_calls == 4
    assert done.spent.tokens == 4 * 15
    assert done.answer_seq is not None
    chain = [e.kind for e in await ledger.causal_chain(done.answer_seq)]
    expected = [k.REQUEST, k.ROUTE, k.PLAN, k.TASK_START, k.TASK_RESULT, k.TASK_VERDICT, k.ANSWER]
    it = iter(chain)
    assert all(kind in it for kind in expected), chain
    assert k.INTENT in ledger.kinds(view.id)
    calls = ledger.bodies_of(k.MODEL_CALL, view.id)
    assert all(isinstance(c["slot"], int) and c["member"] for c in calls)
    # slot affinity by lane
    assert ("cheap", "docs") in pool.leases


async def test_failed_validation_escalates_with_feedback_and_succeeds() -> None:
    def script(member: str, messages: list[dict[str, Any]]) -> str:
        if member == "tiny":
            return "no idea"
        assert "must contain 'OK'" in user_text(messages)  # the retry is informed
        return "OK: the answer"

    plan = {
        "tasks": [
            {
                "id": "t1",
                "lane": "backend",
                "instruction": "Say OK.",
                "assertions": [{"type": "contains", "text": "OK"}],
            }
        ]
    }
    engine, ledger, _ = make_engine(script)
    view = await engine.wait((await engine.submit("say ok", plan=plan)).id, timeout=5)
    assert view.state == "done"
    assert view.answer == "OK: the answer"
    escalations = ledger.bodies_of(k.TASK_ESCALATE, view.id)
    assert escalations == [
        {
            "task": "t1",
            "from_tier": "cheap",
            "to_tier": "capable",
            "reason": "the output must contain 'OK'",
            "failures": ["the output must contain 'OK'"],
        }
    ]
    assert view.tasks[0].attempts == 2
    assert view.tasks[0].tier == "capable"


async def test_top_rung_failure_fails_the_run() -> None:
    engine, _, _ = make_engine(lambda m, msgs: "never")
    plan = {
        "tasks": [
            {
                "id": "t1",
                "lane": "backend",
                "instruction": "x",
                "assertions": [{"type": "regex", "pattern": "^\\d+$"}],
            }
        ]
    }
    view = await engine.wait((await engine.submit("x", plan=plan)).id, timeout=5)
    assert view.state == "failed"
    assert "t1" in (view.error or "")
    assert view.tasks[0].state == "failed"


async def test_garbled_plan_reply_is_rescued() -> None:
    replies = iter(
        [
            "I think the plan is: tasks, lots of them",
            'Sure! Here it is:\n```json\n{"tasks": [{"id": "a", "lane": "backend", '
            '"instruction": "Do A", "needs": []}, {"id": "b", "lane": "docs", '
            '"instruction": "Do B", "needs": ["a"]}]}\n```\nHope that helps.',
        ]
    )

    def script(member: str, messages: list[dict[str, Any]]) -> str:
        if member == "coord":
            return next(replies)
        if "Combine" in str(messages[0]["content"]):
            return "combined"
        return "result"

    engine, ledger, _ = make_engine(script, EngineOptions(coordinator="planner"))
    view = await engine.wait((await engine.submit("plan the backend api docs")).id, timeout=5)
    assert view.state == "done", view.error
    assert [t.id for t in view.tasks] == ["a", "b"]
    guards = ledger.bodies_of(k.GUARD, view.id)
    assert [g["outcome"] for g in guards] == ["invalid", "rescued_fenced"]
    assert ledger.bodies_of(k.PLAN, view.id)[0]["source"] == "coordinator"


async def test_budget_stop_reports_what_was_spent() -> None:
    engine, ledger, _ = make_engine(dag_script)
    view = await engine.submit("api", plan=DAG, budget={"model_calls": 2}, max_parallel=1)
    view = await engine.wait(view.id, timeout=5)
    assert view.state == "budget_exhausted"
    assert view.spent.model_calls == 2
    stop = ledger.bodies_of(k.BUDGET, view.id)[0]
    assert stop["limit"] == "model_calls"
    assert stop["spent"]["model_calls"] == 2


async def test_wall_clock_budget() -> None:
    async def slow(member: str, messages: list[dict[str, Any]]) -> str:
        await asyncio.sleep(10)
        return "late"

    engine, ledger, _ = make_engine(slow)
    view = await engine.submit("backend thing", budget={"wall_s": 0.2})
    view = await engine.wait(view.id, timeout=5)
    assert view.state == "budget_exhausted"
    assert ledger.bodies_of(k.BUDGET, view.id)[0]["limit"] == "wall"


async def test_cancel_aborts_the_model_request_and_starts_nothing_after() -> None:
    started = asyncio.Event()

    async def script(member: str, messages: list[dict[str, Any]]) -> str:
        started.set()
        await asyncio.sleep(30)
        return "never"

    engine, ledger, pool = make_engine(script)
    view = await engine.submit("api", plan=DAG)
    await asyncio.wait_for(started.wait(), 5)
    cancelled = await engine.cancel(view.id)
    assert cancelled.state == "cancelled"
    assert pool.aborted == 1
    assert pool.in_flight == 0
    kinds = ledger.kinds(view.id)
    assert k.TASK_START not in kinds[kinds.index(k.CANCEL) :]
    await asyncio.sleep(0.05)
    assert ledger.kinds(view.id) == kinds
    assert (await engine.cancel(view.id)).state == "cancelled"  # idempotent


async def test_idempotency_key_returns_the_same_run() -> None:
    engine, ledger, _ = make_engine(dag_script)
    first, second = await asyncio.gather(
        engine.submit("backend api", idempotency_key="k1"),
        engine.submit("backend api", idempotency_key="k1"),
    )
    assert first.id == second.id
    assert ledger.kinds().count(k.REQUEST) == 1
    with pytest.raises(Conflict):
        await engine.submit("something else", idempotency_key="k1")


async def test_command_gets_shell_metacharacters_as_literal_arguments(tmp_path: Any) -> None:
    marker = tmp_path / "pwned"
    evil = f"; touch {marker} && echo $HOME | cat `id` $(id)"
    plan = {
        "tasks": [
            {
                "id": "c",
                "lane": "testing",
                "instruction": "run",
                "executor": "command",
                "argv": [
                    sys.executable,
                    "-c",
                    "import json,sys; print(json.dumps(sys.argv[1:]))",
                    evil,
                ],
                "assertions": [{"type": "exit_code", "code": 0}],
            }
        ]
    }
    engine, ledger, _ = make_engine(dag_script)
    view = await engine.wait((await engine.submit("run it", plan=plan)).id, timeout=10)
    assert view.state == "done", view.error
    assert json.loads(view.answer or "") == [evil]
    assert not marker.exists()
    run = ledger.bodies_of(k.COMMAND_RUN, view.id)[0]
    assert run["exit_code"] == 0
    assert run["argv"][-1] == evil


async def test_router_escalates_to_the_classifier() -> None:
    def script(member: str, messages: list[dict[str, Any]]) -> str:
        if "route a request" in str(messages[0]["content"]):
            return '{"lane": "docs"}'
        return "an answer"

    engine, ledger, _ = make_engine(script)
    view = await engine.wait((await engine.submit("something vague")).id, timeout=5)
    assert view.state == "done"
    assert view.lane == "docs"
    assert ledger.bodies_of(k.CLASSIFY, view.id)[0]["source"] == "model"


async def test_replay_equals_live_state() -> None:
    engine, ledger, _ = make_engine(dag_script)
    ids = [(await engine.submit(f"api {i}", plan=DAG)).id for i in range(3)]
    for run_id in ids:
        await engine.wait(run_id, timeout=5)
    views = await replay(ledger)
    for run_id in ids:
        assert views[run_id].model_dump() == engine.get(run_id).model_dump()
    # and at an earlier seq: the state as it stood then
    first_answer = engine.get(ids[0]).answer_seq
    assert first_answer is not None
    early = await replay(ledger, until=first_answer)
    assert early[ids[0]].answer == engine.get(ids[0]).answer
    assert early[ids[0]].state == "synthesizing"


async def test_events_stream_to_the_final_state_with_deltas() -> None:
    gate = asyncio.Event()

    async def script(member: str, messages: list[dict[str, Any]]) -> str:
        await gate.wait()
        return dag_script(member, messages)

    engine, _, _ = make_engine(script)
    view = await engine.submit("api", plan=DAG)
    seen: list[Any] = []

    async def follow() -> None:
        async for event in engine.events(view.id):
            seen.append(event)

    follower = asyncio.create_task(follow())
    await asyncio.sleep(0.05)
    gate.set()
    await asyncio.wait_for(follower, 5)
    assert seen[0].kind == k.REQUEST
    assert seen[-1].kind == k.STATE
    assert seen[-1].data == {"state": "done", "error": None}
    assert any(e.kind == "delta" for e in seen)
    seqs = [e.seq for e in seen if e.seq is not None]
    assert seqs == sorted(set(seqs))
    # a finished run's stream replays and ends; `after` resumes from a seq
    again = [e async for e in engine.events(view.id, after=seqs[2])]
    assert [e.seq for e in again] == seqs[3:]


async def test_interrupted_run_resumes_reusing_done_tasks() -> None:
    hang = asyncio.Event()

    async def first(member: str, messages: list[dict[str, Any]]) -> str:
        if "Test it" in user_text(messages):
            await hang.wait()
        return dag_script(member, messages)

    chain = {
        "tasks": [
            {"id": "api", "lane": "backend", "instruction": "Design the API."},
            {"id": "doc", "lane": "docs", "instruction": "Document it.", "needs": ["api"]},
            {"id": "test", "lane": "testing", "instruction": "Test it.", "needs": ["doc"]},
        ]
    }
    engine, ledger, _ = make_engine(first)
    view = await engine.submit("backend api", plan=chain)
    for _ in range(500):
        if any(b["task"] == "test" for b in ledger.bodies_of(k.TASK_START, view.id)):
            break
        await asyncio.sleep(0.01)
    await engine.shutdown(drain_s=0)
    assert engine.get(view.id).state == "interrupted"

    roster = make_roster()
    pool2 = ScriptedPool(roster, dag_script)
    engine2 = Engine(ledger, pool2, roster, KeywordRouter(roster))
    assert await engine2.restore() == []  # already interrupted, witnessed by the stop
    assert engine2.get(view.id).state == "interrupted"
    await engine2.resume(view.id)
    done = await engine2.wait(view.id, timeout=5)
    assert done.state == "done", done.error
    # only the unfinished task and the synthesis were asked of a model
    assert len(pool2.calls) == 2
    assert ledger.bodies_of(k.RESUME, view.id)[0]["reused"] == ["api", "doc"]


async def test_restore_marks_in_flight_runs_interrupted() -> None:
    ledger = MemoryLedger()
    await ledger.append(actor="engine", kind=k.REQUEST, body={"request": "x"}, run="r1")
    roster = make_roster()
    engine = Engine(ledger, ScriptedPool(roster, dag_script), roster, KeywordRouter(roster))
    assert await engine.restore() == ["r1"]
    assert engine.get("r1").state == "interrupted"
    assert ledger.kinds("r1") == [k.REQUEST, k.INTERRUPTED]
