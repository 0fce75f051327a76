"""The engine over in-memory fakes: edge cases of the control loop, fast.

The issue's scenarios (DAG, escalation, rescue, budget, cancel, idempotency, command) run
through the real Daemon, ledger and pool in `test_daemon_runs.py`.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest

from daemon.errors import Busy
from daemon.ledger import Ledger
from daemon.runs import entries as k
from daemon.runs import snapshot as snapshots
from daemon.runs.engine import Engine, EngineOptions
from daemon.runs.replay import replay
from daemon.runs.state import Census, RunView
from daemon.slots.records import ledger_timings
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


async def test_wall_clock_budget() -> None:
    async def slow(member: str, messages: list[dict[str, Any]]) -> str:
        await asyncio.sleep(10)
        return "late"

    engine, ledger, _ = make_engine(slow)
    view = await engine.submit("backend thing", budget={"wall_s": 0.2})
    view = await engine.wait(view.id, timeout=5)
    assert view.state == "budget_exhausted"
    assert ledger.bodies_of(k.BUDGET, view.id)[0]["limit"] == "wall"


async def test_router_escalates_to_the_classifier() -> None:
    def script(member: str, messages: list[dict[str, Any]]) -> str:
        if "route a request" in str(messages[0]["content"]):
            return '{"lane": "docs"}'
        return "an answer"

    engine, ledger, _ = make_engine(script, classifier="capable")
    view = await engine.wait((await engine.submit("something vague")).id, timeout=5)
    assert view.state == "done"
    assert view.lane == "docs"
    classified = ledger.bodies_of(k.CLASSIFY, view.id)[0]
    assert classified["source"] == "model"
    assert len(classified["candidates"]) <= 4  # the best-scoring few, not every lane


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


def census_totals(census: Census) -> tuple[Any, ...]:
    runs = {s: n for s, n in census.runs.items() if n}
    tasks = {s: n for s, n in census.tasks.items() if n}
    return runs, tasks, census.model_calls, census.tokens


async def test_census_follows_every_change_of_run_state() -> None:
    hang = asyncio.Event()

    async def stuck_on_tests(member: str, messages: list[dict[str, Any]]) -> str:
        if "Test it" in user_text(messages):
            await hang.wait()
        return dag_script(member, messages)

    engine, ledger, _ = make_engine(stuck_on_tests)
    done = await engine.submit("api", plan={"tasks": DAG["tasks"][:2]})
    await engine.wait(done.id, timeout=5)
    stuck = await engine.submit("api", plan=DAG)
    for _ in range(500):
        if any(b["task"] == "test" for b in ledger.bodies_of(k.TASK_START, stuck.id)):
            break
        await asyncio.sleep(0.01)
    assert engine.census.active() == 1
    await engine.shutdown(drain_s=0)
    expected = Census.of((await replay(ledger)).values())
    assert census_totals(engine.census) == census_totals(expected)
    assert engine.census.active() == 0

    roster = make_roster()
    engine2 = Engine(ledger, ScriptedPool(roster, dag_script), roster, KeywordRouter(roster))
    await engine2.restore()
    await engine2.resume(stuck.id)
    await engine2.wait(stuck.id, timeout=5)
    expected = Census.of((await replay(ledger)).values())
    assert census_totals(engine2.census) == census_totals(expected)
    assert engine2.census.runs["done"] == 2


async def test_restore_marks_in_flight_runs_interrupted() -> None:
    ledger = MemoryLedger()
    await ledger.append(actor="engine", kind=k.REQUEST, body={"request": "x"}, run="r1")
    roster = make_roster()
    engine = Engine(ledger, ScriptedPool(roster, dag_script), roster, KeywordRouter(roster))
    assert await engine.restore() == ["r1"]
    assert engine.get("r1").state == "interrupted"
    assert ledger.kinds("r1") == [k.REQUEST, k.INTERRUPTED]


def test_ledger_timings_keep_counts_and_turn_milliseconds_into_microseconds() -> None:
    raw = {
        "cache_n": 2,
        "prompt_n": 5,
        "prompt_ms": 12.5,
        "prompt_per_token_ms": 2.5,
        "prompt_per_second": 400.0,
        "predicted_n": 3,
        "predicted_ms": 30.25,
        "draft": True,
        "note": "x",
    }
    assert ledger_timings(raw) == {
        "cache_n": 2,
        "prompt_n": 5,
        "prompt_us": 12500,
        "predicted_n": 3,
        "predicted_us": 30250,
    }
    assert ledger_timings(None) == {}


async def _states(ledger: MemoryLedger, run_id: str) -> list[str]:
    """The run's state after each of its entries, as replay reads it: no repeats."""
    seen: list[str] = []
    for entry in await ledger.entries(limit=10_000, run=run_id):
        state = (await replay(ledger, until=entry.seq))[run_id].state
        if not seen or seen[-1] != state:
            seen.append(state)
    return seen


async def test_run_reads_routing_while_its_lane_is_open() -> None:
    def script(member: str, messages: list[dict[str, Any]]) -> str:
        if "route a request" in str(messages[0]["content"]):
            return '{"lane": "docs"}'
        return "an answer"

    engine, ledger, _ = make_engine(script, classifier="capable")
    vague = await engine.wait((await engine.submit("something vague")).id, timeout=5)
    routed = await engine.wait((await engine.submit("backend api")).id, timeout=5)
    # escalated to the classifier: routing from run.route until run.classify, never back
    assert await _states(ledger, vague.id) == ["queued", "routing", "planning", "running", "done"]
    # a confident keyword route decides the lane in its own entry (see replay._route)
    assert await _states(ledger, routed.id) == ["queued", "planning", "running", "done"]


async def test_a_stopping_daemon_answers_busy_not_an_internal_error() -> None:
    engine, _, _ = make_engine(lambda member, messages: "x")
    await engine.shutdown(0)
    with pytest.raises(Busy) as caught:
        await engine.submit("backend api")
    assert caught.value.status == 503
    assert caught.value.retry_after > 0


async def test_an_idempotency_key_expires_after_its_ttl() -> None:
    engine, _, _ = make_engine(lambda member, messages: "x", options=EngineOptions(key_ttl_s=0.05))
    first = await engine.submit("backend api", idempotency_key="k1")
    assert (await engine.submit("backend api", idempotency_key="k1")).id == first.id
    await asyncio.sleep(0.1)
    again = await engine.submit("backend api", idempotency_key="k1")
    assert again.id != first.id  # past its TTL the key starts a new run


async def test_idempotency_keys_are_bounded_oldest_first() -> None:
    engine, _, _ = make_engine(lambda member, messages: "x", options=EngineOptions(max_keys=2))
    runs = [await engine.submit("backend api", idempotency_key=f"k{i}") for i in range(3)]
    assert (await engine.submit("backend api", idempotency_key="k2")).id == runs[2].id
    assert (await engine.submit("backend api", idempotency_key="k0")).id != runs[0].id


async def test_a_snapshot_is_written_compacted_from_views_nothing_changes(
    tmp_path: Path,
) -> None:
    engine, _, _ = make_engine(dag_script)
    done = await engine.wait((await engine.submit("api", plan=DAG)).id, timeout=5)
    assert done.state == "done"
    size, views, summaries = engine.snapshot()
    assert summaries == []  # a finished run within keep_runs is held in full
    [view] = [v for v in views if v.id == done.id]
    assert view.model_dump() == done.model_dump()
    snapshots.write(tmp_path, snapshots.Snapshot(size=size, root="", leaf="", views=views))
    loaded = snapshots.Snapshot.model_validate_json((tmp_path / snapshots.FILE).read_bytes())
    [back] = [v for v in loaded.views if v.id == done.id]
    assert back.plan is None  # replay reads the plan and the results back on demand
    assert [t.result for t in back.tasks] == [None, None, None]
    assert back == done.compacted()


# ---------------------------------------------------------------- a caller that stops waiting


async def held_engine(state_dir: Path, script: Any) -> tuple[Engine, Ledger, threading.Event]:
    """The engine over the real ledger, whose commits wait for the returned event: an
    append's wait can be cancelled while the writer still commits it (as the real one does)."""
    roster = make_roster()
    ledger = await Ledger.open(state_dir, checkpoint_interval=None)
    engine = Engine(ledger, ScriptedPool(roster, script), roster, KeywordRouter(roster))
    gate = threading.Event()
    gate.set()

    def hold(step: str) -> None:
        if step == "journal written":
            assert gate.wait(10)

    ledger.step_hook = hold
    return engine, ledger, gate


async def cancelled_mid_commit(ledger: Ledger, gate: threading.Event, call: Any) -> None:
    """Start `call`, cancel it while its append waits on the held writer, then let go and
    wait until the writer has committed it."""
    gate.clear()
    task = asyncio.create_task(call)
    await asyncio.sleep(0.1)  # its entry is queued and the writer holds it
    size = ledger.size
    task.cancel()
    gate.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(200):
        if ledger.size > size:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the held entry was never committed")


async def agree_with_replay(engine: Engine, ledger: Ledger, run_id: str) -> RunView:
    view = await engine.wait(run_id, timeout=10)
    replayed = (await replay(ledger))[run_id]
    assert (view.state, view.tasks) == (replayed.state, replayed.tasks)
    return view


async def test_a_submit_whose_caller_stops_waiting_still_runs(state_dir: Path) -> None:
    engine, ledger, gate = await held_engine(state_dir, dag_script)
    await cancelled_mid_commit(ledger, gate, engine.submit("api", plan=DAG, idempotency_key="once"))
    # The request is in the record, so the engine drives it (before, the entry was committed
    # and no view or run followed it; the key was forgotten, so a retry ran it twice).
    [request] = await ledger.entries(kind=k.REQUEST)
    assert request.run is not None
    assert (await agree_with_replay(engine, ledger, request.run)).state == "done"
    again = await engine.submit("api", plan=DAG, idempotency_key="once")
    assert again.id == request.run
    assert len(await ledger.entries(kind=k.REQUEST)) == 1
    await engine.shutdown()
    await ledger.close()


async def test_a_submit_in_flight_as_shutdown_begins_is_interrupted_with_the_rest(
    state_dir: Path,
) -> None:
    hang = asyncio.Event()

    async def script(member: str, messages: list[dict[str, Any]]) -> str:
        await hang.wait()
        return dag_script(member, messages)

    engine, ledger, gate = await held_engine(state_dir, script)
    gate.clear()
    submit = asyncio.create_task(engine.submit("api", plan=DAG))
    await asyncio.sleep(0.1)  # its request waits on the held writer
    stopping = asyncio.create_task(engine.shutdown(drain_s=0.1))
    await asyncio.sleep(0.05)
    gate.set()
    view = await submit
    await asyncio.wait_for(stopping, 10)
    # Before, the run started after shutdown had looked at the runs: it kept running (its
    # model call waiting) with the daemon gone, and its record said nothing of it.
    assert engine.get(view.id).state == "interrupted"
    assert [e.kind for e in await ledger.entries(run=view.id)][-1] == k.INTERRUPTED
    with pytest.raises(Busy):
        await engine.submit("api", plan=DAG)
    hang.set()
    await ledger.close()


async def test_a_cancel_whose_caller_stops_waiting_still_cancels(state_dir: Path) -> None:
    hang = asyncio.Event()

    async def script(member: str, messages: list[dict[str, Any]]) -> str:
        await hang.wait()
        return dag_script(member, messages)

    engine, ledger, gate = await held_engine(state_dir, script)
    view = await engine.submit("api", plan=DAG)
    await asyncio.sleep(0.05)  # its first calls wait on the model
    await cancelled_mid_commit(ledger, gate, engine.cancel(view.id))
    assert (await agree_with_replay(engine, ledger, view.id)).state == "cancelled"
    assert [e.kind for e in await ledger.entries(run=view.id)][-2:] == [k.CANCEL, k.STATE]
    size, views, _ = engine.snapshot()  # the reduction of the whole record, as replay's
    assert size == ledger.size
    assert [v.state for v in views if v.id == view.id] == ["cancelled"]
    await engine.shutdown()
    await ledger.close()
