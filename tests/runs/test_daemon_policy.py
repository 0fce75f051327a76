"""Engine behaviours through the real Daemon: what a model call witnesses, budgets, executor
errors, `on_task_failure = "continue"`, the `max_runs` gate, and cancelling a command."""

from __future__ import annotations

import asyncio
import gc
import logging
import subprocess
import sys
import uuid

import pytest

from daemon.runs import entries as k
from tests.runs.conftest import Factory
from tests.runs.dag import DAG, DAG_RULES, bodies, kinds


async def test_model_call_witnesses_every_request_parameter(fleet: Factory) -> None:
    daemon, server = await fleet(
        [("backend", "an answer", 0.0)], sampling="temperature = 0.25, top_k = 40, seed = 7"
    )
    view = await daemon.engine.wait((await daemon.engine.submit("backend api")).id, timeout=20)
    assert view.state == "done", view.error
    (call,) = await bodies(daemon, k.MODEL_CALL, view.id)
    request = k.unsafe(call["request"])
    assert isinstance(request, dict)
    assert request["temperature"] == 0.25  # a float, kept out of the hash by `safe`
    assert call["request"]["temperature"] == {"__float__": "0.25"}
    assert request["top_k"] == 40
    assert request["seed"] == 7
    assert request["model"] == "tiny"
    assert request["stream"] is True  # every chat task streams its tokens to watchers
    assert request["stream_options"] == {"include_usage": True}
    assert request["cache_prompt"] is True
    assert request["id_slot"] == call["slot"]
    assert request["max_tokens"] > 0
    # exactly what reached the server, so the reply has nothing more to say
    (sent,) = server.requests
    assert request == sent
    (reply,) = await bodies(daemon, k.MODEL_REPLY, view.id)
    assert reply["sent"] is None


async def test_token_budget_ends_the_run_with_what_it_spent(fleet: Factory) -> None:
    daemon, server = await fleet(DAG_RULES)
    view = await daemon.engine.submit("api", plan=DAG, budget={"tokens": 20}, max_parallel=1)
    view = await daemon.engine.wait(view.id, timeout=20)
    assert view.state == "budget_exhausted"
    assert view.error == "budget exhausted: tokens"
    # 15 tokens a reply: the second reply crosses 20 and nothing is asked after it
    assert view.spent.tokens == 30
    assert view.spent.model_calls == 2 == len(server.requests)
    (stop,) = await bodies(daemon, k.BUDGET, view.id)
    assert stop["limit"] == "tokens"
    assert stop["budget"]["tokens"] == 20
    assert stop["spent"]["tokens"] == 30
    assert stop["spent"]["model_calls"] == 2
    # the task done within the budget is the run's (partial) answer still
    assert (await kinds(daemon, view.id))[-3:] == [k.BUDGET, k.ANSWER, k.STATE]
    (answer,) = await bodies(daemon, k.ANSWER, view.id)
    assert answer["source"] == "partial"


async def test_executor_error_escalates_with_the_error_in_the_retry_prompt(
    fleet: Factory,
) -> None:
    daemon, server = await fleet([("backend", "an answer", 0.0)], policy={"attempts_per_rung": 1})
    server.fail_next = 1  # the first attempt's task call gets a 500
    view = await daemon.engine.wait((await daemon.engine.submit("backend api")).id, timeout=20)
    assert view.state == "done", view.error
    assert view.answer == "an answer"
    (task,) = view.tasks
    assert task.attempts == 2
    assert task.tier == "capable"
    first, second = await bodies(daemon, k.TASK_RESULT, view.id)
    assert first["ok"] is False
    assert "500" in first["error"]
    (escalate,) = await bodies(daemon, k.TASK_ESCALATE, view.id)
    assert (escalate["from_tier"], escalate["to_tier"]) == ("cheap", "capable")
    assert escalate["reason"] == f"the executor failed: {first['error']}"
    calls = await bodies(daemon, k.MODEL_CALL, view.id)
    assert [c["member"] for c in calls] == ["tiny", "big"]
    retry = server.requests[1]["messages"][-1]["content"]
    assert "A previous attempt at this task failed these checks" in retry
    assert first["error"] in retry
    assert second["ok"] is True


async def test_continue_policy_skips_dependants_and_finishes_the_rest(fleet: Factory) -> None:
    plan = {
        "tasks": [
            {
                "id": "bad",
                "lane": "backend",
                "instruction": "Design the API.",
                "assertions": [{"type": "contains", "text": "NEVER-SAID"}],
            },
            {"id": "dep", "lane": "docs", "instruction": "Document it.", "needs": ["bad"]},
            {"id": "solo", "lane": "testing", "instruction": "Test it."},
        ]
    }
    daemon, server = await fleet(
        DAG_RULES, policy={"on_task_failure": "continue", "attempts_per_rung": 1}
    )
    view = await daemon.engine.wait((await daemon.engine.submit("api", plan=plan)).id, timeout=20)
    states = {t.id: t.state for t in view.tasks}
    assert states == {"bad": "failed", "dep": "skipped", "solo": "done"}
    # the run answers from what finished: done, no error, synthesized from `solo` alone
    assert view.state == "done", view.error
    assert view.error is None
    assert view.answer is not None
    summary, *results = view.answer.split("\n\n## ")
    assert summary == "FINAL ANSWER about the api, docs and tests"
    assert [r.split("\n", 1)[0] for r in results] == ["solo (testing)"]  # the done task only
    (skip,) = await bodies(daemon, k.TASK_SKIP, view.id)
    assert skip["task"] == "dep"
    synthesis = server.requests[-1]["messages"][-1]["content"]
    assert "## Result of solo\ntests for GET /items" in synthesis
    assert "Result of bad" not in synthesis
    assert not any("Document it" in str(r["messages"]) for r in server.requests)
    verdicts = [v for v in await bodies(daemon, k.TASK_VERDICT, view.id) if v["task"] == "bad"]
    assert [v["next"] for v in verdicts] == ["escalate", "failed"]


async def test_max_runs_keeps_a_second_run_queued_until_the_first_ends(fleet: Factory) -> None:
    daemon, _ = await fleet(
        [("slow backend", "first", 0.6), ("backend", "second", 0.0)], policy={"max_runs": 1}
    )
    first = await daemon.engine.submit("slow backend api")
    second = await daemon.engine.submit("backend api")
    for _ in range(500):
        if daemon.engine.get(first.id).state == "running":
            break
        await asyncio.sleep(0.01)
    seen: set[str] = set()
    while daemon.engine.get(first.id).state not in ("done", "failed"):
        seen.add(daemon.engine.get(second.id).state)
        await asyncio.sleep(0.02)
    assert seen == {"queued"}
    done = await daemon.engine.wait(second.id, timeout=20)
    assert done.state == "done"
    assert done.answer == "second"
    first_end = (await daemon.ledger.entries(limit=10_000, kind=k.STATE, run=first.id))[0].seq
    second_route = (await daemon.ledger.entries(limit=10_000, kind=k.ROUTE, run=second.id))[0].seq
    assert second_route > first_end


def _marked(marker: str) -> bool:
    """A live (not zombie) process whose command line holds `marker`."""
    found = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True, check=False)
    return any(not _gone(int(pid)) for pid in found.stdout.split())


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie is dead, unreaped
    except FileNotFoundError:
        return True


async def test_cancel_kills_a_command_and_what_it_started(
    fleet: Factory, caplog: pytest.LogCaptureFixture
) -> None:
    # The task runs sandboxed (its own PID namespace, no view of tmp_path): find the grandchild
    # on the host by a marker in its argv.
    marker = f"tally-grandchild-{uuid.uuid4().hex}"
    script = (
        "import subprocess, sys, time; "
        f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300) # {marker}']); "
        "time.sleep(300)"
    )
    plan = {
        "tasks": [
            {
                "id": "c",
                "lane": "testing",
                "instruction": "run",
                "executor": "command",
                "argv": [sys.executable, "-c", script],
            }
        ]
    }
    daemon, _ = await fleet([])
    caplog.set_level(logging.ERROR, logger="asyncio")
    view = await daemon.engine.submit("run it", plan=plan)
    for _ in range(1000):
        if _marked(marker):
            break
        await asyncio.sleep(0.01)
    else:
        pytest.fail("the command never started its grandchild")
    cancelled = await daemon.engine.cancel(view.id)
    assert cancelled.state == "cancelled"
    for _ in range(200):
        if not _marked(marker):
            break
        await asyncio.sleep(0.01)
    assert not _marked(marker)
    gc.collect()  # an unretrieved future's exception is logged when it is collected
    await asyncio.sleep(0.05)
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]
