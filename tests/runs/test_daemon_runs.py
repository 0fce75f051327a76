"""The issue's run scenarios through the real Daemon: real Ledger, real Pool, fake model server.

Nothing of tally's own is faked here: the pool leases real slots of a llama-server-compatible
fake (`tests.runs.model_server.ScriptedServer`) and every entry is fsynced to the file ledger.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from daemon.errors import Conflict
from daemon.runs import entries as k
from daemon.service import Daemon
from tests.runs.conftest import Factory
from tests.runs.dag import DAG, DAG_RULES, bodies, kinds
from tests.runs.model_server import ScriptedServer

PRINT_ARGV = "import json, sys; print(json.dumps(sys.argv[1:]))"


def user_texts(server: ScriptedServer) -> list[str]:
    return [
        "\n".join(str(m["content"]) for m in r["messages"] if m["role"] == "user")
        for r in server.requests
    ]


async def test_three_task_dag_with_scripted_replies(fleet: Factory) -> None:
    daemon, server = await fleet(DAG_RULES)
    view = await daemon.engine.submit("build an api with docs", plan=DAG)
    done = await daemon.engine.wait(view.id, timeout=20)
    assert done.state == "done", done.error
    assert done.answer is not None
    assert done.answer.startswith("FINAL ANSWER about the api")
    assert [t.state for t in done.tasks] == ["done", "done", "done"]
    assert done.spent.model_calls == 4 == len(server.requests)
    assert done.spent.tokens == 4 * 15
    # upstream results reach dependants
    doc_prompt = next(t for t in user_texts(server) if "Document it" in t)
    assert "GET /items" in doc_prompt
    calls = await bodies(daemon, k.MODEL_CALL, view.id)
    assert all(isinstance(c["slot"], int) and c["member"] == "tiny" for c in calls)
    # witnessed before sending, the streamed synthesis too: each is what the server received
    witnessed = sorted(json.dumps(k.unsafe(c["request"]), sort_keys=True) for c in calls)
    assert witnessed == sorted(json.dumps(r, sort_keys=True) for r in server.requests)
    assert calls[-1]["request"]["stream"] is True
    assert all(r["sent"] is None for r in await bodies(daemon, k.MODEL_REPLY, view.id))
    assert done.answer_seq is not None
    chain = [e.kind for e in await daemon.ledger.causal_chain(done.answer_seq)]
    expected = [k.REQUEST, k.ROUTE, k.PLAN, k.TASK_START, k.TASK_RESULT, k.TASK_VERDICT, k.ANSWER]
    it = iter(chain)
    assert all(kind in it for kind in expected), chain
    assert k.INTENT in await kinds(daemon, view.id)
    assert (await daemon.ledger.verify(deep=True)).ok


async def test_failed_validation_escalates_to_the_next_rung(fleet: Factory) -> None:
    # Both members are the same server: the first attempt says "no idea", the second (carrying
    # what failed) says OK.
    # One attempt per rung: a failure climbs at once (informed retry on a rung: test_workspace_runs)
    daemon, server = await fleet(
        [("must contain 'OK'", "OK: the answer", 0.0)], policy={"attempts_per_rung": 1}
    )
    server.default = "no idea"
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
    view = await daemon.engine.wait((await daemon.engine.submit("say ok", plan=plan)).id, 20)
    assert view.state == "done", view.error
    assert view.answer == "OK: the answer"
    assert (await bodies(daemon, k.TASK_ESCALATE, view.id)) == [
        {
            "task": "t1",
            "from_tier": "cheap",
            "to_tier": "capable",
            "reason": "the output must contain 'OK'",
            "failures": ["the output must contain 'OK'"],
        }
    ]
    members = [c["member"] for c in await bodies(daemon, k.MODEL_CALL, view.id)]
    assert members == ["tiny", "big"]
    assert view.tasks[0].attempts == 2
    assert view.tasks[0].tier == "capable"


async def test_garbled_plan_reply_is_rescued(fleet: Factory) -> None:
    plan_replies = [
        "I think the plan is: tasks, lots of them",
        'Sure! Here it is:\n```json\n{"tasks": [{"id": "a", "lane": "backend", '
        '"instruction": "Do A", "needs": []}, {"id": "b", "lane": "docs", '
        '"instruction": "Do B", "needs": ["a"]}]}\n```\nHope that helps.',
    ]
    daemon, server = await fleet(
        [
            ("You route a request", '{"lane": "backend"}', 0.0),
            ("You split a request", plan_replies, 0.0),
            ("Combine", "combined", 0.0),
        ],
        policy={"classifier": "capable"},
        coordinator="big",
    )
    view = await daemon.engine.submit("plan the backend api docs")
    view = await daemon.engine.wait(view.id, timeout=20)
    assert view.state == "done", view.error
    assert [t.id for t in view.tasks] == ["a", "b"]
    guards = await bodies(daemon, k.GUARD, view.id)
    assert [(g["purpose"], g["outcome"]) for g in guards] == [
        ("classify", "parsed"),
        ("plan", "invalid"),
        ("plan", "rescued_fenced"),
    ]
    assert (await bodies(daemon, k.PLAN, view.id))[0]["source"] == "coordinator"
    # the retry told the model what was wrong
    planning = [r for r in server.requests if "You split" in r["messages"][0]["content"]]
    assert len(planning) == 2
    assert len(planning[1]["messages"]) > len(planning[0]["messages"])
    assert planning[0]["response_format"]["type"] == "json_schema"


async def test_budget_stop(fleet: Factory) -> None:
    daemon, server = await fleet(DAG_RULES)
    view = await daemon.engine.submit("api", plan=DAG, budget={"model_calls": 2}, max_parallel=1)
    view = await daemon.engine.wait(view.id, timeout=20)
    assert view.state == "budget_exhausted"
    assert view.spent.model_calls == 2 == len(server.requests)
    stop = (await bodies(daemon, k.BUDGET, view.id))[0]
    assert stop["limit"] == "model_calls"
    assert stop["spent"]["model_calls"] == 2
    assert stop["spent"]["tokens"] == 30


async def test_cancel_mid_run_aborts_the_request_and_starts_nothing_after(fleet: Factory) -> None:
    daemon, server = await fleet([("Design the API", "never", 30.0), *DAG_RULES])
    view = await daemon.engine.submit("api", plan=DAG)
    for _ in range(500):
        if server.in_flight():
            break
        await asyncio.sleep(0.01)
    else:
        pytest.fail("the first task never reached the model server")
    cancelled = await daemon.engine.cancel(view.id)
    assert cancelled.state == "cancelled"
    for _ in range(200):  # the server learns of the closed connection asynchronously
        if server.aborted and not server.in_flight():
            break
        await asyncio.sleep(0.01)
    assert server.aborted == 1
    assert server.in_flight() == 0
    status = daemon.pool.status()
    tiny = next(m for m in status.members if m.name == "tiny")
    assert tiny.leases == 0
    assert all(i.slots_busy == 0 for i in tiny.instances)
    seen = await kinds(daemon, view.id)
    assert k.TASK_START not in seen[seen.index(k.CANCEL) :]
    await asyncio.sleep(0.2)
    assert await kinds(daemon, view.id) == seen
    assert len(server.requests) == 1
    assert (await daemon.engine.cancel(view.id)).state == "cancelled"  # idempotent


async def test_idempotency_key_returns_the_same_run(fleet: Factory) -> None:
    daemon, _ = await fleet([("backend", "an answer", 0.0)])
    first, second = await asyncio.gather(
        daemon.engine.submit("backend api", idempotency_key="k1"),
        daemon.engine.submit("backend api", idempotency_key="k1"),
    )
    assert first.id == second.id
    requests = await daemon.ledger.entries(start=0, limit=10_000, kind=k.REQUEST)
    assert len(requests) == 1
    with pytest.raises(Conflict):
        await daemon.engine.submit("something else", idempotency_key="k1")
    await daemon.engine.wait(first.id, timeout=20)


async def test_idempotency_key_survives_a_restart(fleet: Factory) -> None:
    daemon, _ = await fleet([("backend", "an answer", 0.0)])
    first = await daemon.engine.submit("backend api", idempotency_key="k2")
    await daemon.engine.wait(first.id, timeout=20)
    await daemon.stop()
    again = Daemon(daemon.settings)
    await again.start()
    try:
        second = await again.engine.submit("backend api", idempotency_key="k2")
        assert second.id == first.id
        assert second.state == "done"
    finally:
        await again.stop()


async def test_command_gets_shell_metacharacters_as_literal_arguments(
    fleet: Factory, tmp_path: Path
) -> None:
    marker = tmp_path / "pwned"
    evil = f"; touch {marker} && echo $HOME | cat `id` $(id) > {marker}"
    plan = {
        "tasks": [
            {
                "id": "c",
                "lane": "testing",
                "instruction": "run",
                "executor": "command",
                "argv": [sys.executable, "-c", PRINT_ARGV, evil, "*"],
                "assertions": [{"type": "exit_code", "code": 0}],
            }
        ]
    }
    daemon, server = await fleet([])
    view = await daemon.engine.submit("run it", plan=plan)
    view = await daemon.engine.wait(view.id, timeout=20)
    assert view.state == "done", view.error
    assert json.loads(view.answer or "") == [evil, "*"]
    assert not marker.exists()
    run = (await bodies(daemon, k.COMMAND_RUN, view.id))[0]
    assert run["exit_code"] == 0
    assert run["argv"][-2:] == [evil, "*"]
    assert server.requests == []  # a single command task needs no model


async def test_roster_policy_names_the_coordinator_and_the_judge(fleet: Factory) -> None:
    """`[policy] coordinator/judge` in the roster turn on model planning and judging."""
    daemon, server = await fleet(
        [
            (
                "You check whether",
                ['{"ok": false, "reason": "too vague"}', '{"ok": true, "reason": "fine"}'],
                0.0,
            ),
            ("You route a request", '{"lane": "backend"}', 0.0),
            (
                "You split a request",
                '{"tasks": [{"id": "a", "lane": "backend", "instruction": "Do A", "needs": []}]}',
                0.0,
            ),
            ("Do A", ["draft one", "draft two"], 0.0),
        ],
        policy={"coordinator": "big", "judge": "capable", "attempts_per_rung": 1},
    )
    view = await daemon.engine.wait((await daemon.engine.submit("backend work")).id, timeout=20)
    assert view.state == "done", view.error
    assert (await bodies(daemon, k.PLAN, view.id))[0]["source"] == "coordinator"
    assert view.answer == "draft two"
    escalation = (await bodies(daemon, k.TASK_ESCALATE, view.id))[0]
    assert escalation["failures"] == ["the judge found: too vague"]
    judged = [r for r in server.requests if "You check whether" in r["messages"][0]["content"]]
    assert len(judged) == 2
    assert "draft one" in judged[0]["messages"][-1]["content"]


async def test_a_done_runs_intent_and_state_share_one_group_commit(fleet: Factory) -> None:
    daemon, _ = await fleet([])
    view = await daemon.engine.submit("fix the backend handler")
    done = await daemon.engine.wait(view.id, timeout=20)
    assert done.state == "done", done.error
    found = await daemon.ledger.entries(start=0, limit=100, run=view.id)
    answer, intent, state = found[-3:]
    assert [answer.kind, intent.kind, state.kind] == [k.ANSWER, k.INTENT, k.STATE]
    assert intent.parent == answer.seq
    assert state.parent == answer.seq
    assert state.seq == intent.seq + 1
    # The file ledger stamps a batch with one time: two commits in turn would differ.
    assert intent.ts == state.ts > answer.ts
    assert (await daemon.ledger.body(state.body)).value == {"state": "done", "error": None}
