"""The dispatcher on fake executors; and the guard, checks and command executor."""

from __future__ import annotations

import asyncio
import sys
import time

import pytest

from daemon.runs import checks
from daemon.runs.dispatch import Capacity, Node, dispatch, levels
from daemon.runs.executors import run_command, upstream_block
from daemon.runs.guard import GuardFailed, first_balanced_object, parse_json, structured


async def test_a_task_starts_when_its_needs_are_done_not_at_a_wave_boundary() -> None:
    # a -> c, b independent: c must start after a, while b still runs. b finishes only once c
    # has started, so a dispatcher that waited for the wave (a and b) would never finish.
    nodes = [Node("a", "x"), Node("b", "x"), Node("c", "x", ("a",))]
    order: list[str] = []
    c_started = asyncio.Event()

    async def execute(task_id: str) -> bool:
        order.append(f"start {task_id}")
        if task_id == "c":
            c_started.set()
        if task_id == "b":
            await c_started.wait()
        order.append(f"end {task_id}")
        return True

    out = await asyncio.wait_for(dispatch(nodes, execute, max_parallel=4), 5)
    assert out.done == {"a", "b", "c"}
    assert order.index("end a") < order.index("start c") < order.index("end b")
    barrier_order: list[str] = []

    async def logged(task_id: str) -> bool:
        barrier_order.append(f"start {task_id}")
        await asyncio.sleep(0)
        barrier_order.append(f"end {task_id}")
        return True

    await dispatch(nodes, logged, max_parallel=4, barrier=True)
    # with a barrier, the second wave (c) starts only after the whole first wave (a, b) ended
    assert barrier_order.index("start c") > max(
        barrier_order.index("end a"), barrier_order.index("end b")
    )


async def test_caps_bound_concurrency() -> None:
    running = 0
    peak = 0
    lane_peak = 0
    lane_running = 0

    async def execute(task_id: str) -> bool:
        nonlocal running, peak, lane_running, lane_peak
        running += 1
        lane_running += task_id.startswith("s")
        peak = max(peak, running)
        lane_peak = max(lane_peak, lane_running)
        await asyncio.sleep(0.01)
        running -= 1
        lane_running -= task_id.startswith("s")
        return True

    nodes = [Node(f"s{i}", "slow") for i in range(6)] + [Node(f"f{i}", "fast") for i in range(6)]
    capacity = Capacity(total=3, lanes={"slow": 1})
    out = await dispatch(nodes, execute, max_parallel=5, capacity=capacity)
    assert len(out.done) == 12
    assert peak <= 3
    assert lane_peak == 1
    assert capacity.busy == 0


def test_a_freed_slot_wakes_the_first_waiter_that_can_use_it_and_only_it() -> None:
    capacity = Capacity(total=2, lanes={"slow": 1})
    assert capacity.try_acquire("slow")
    assert capacity.try_acquire("fast")
    waiters = [asyncio.Event() for _ in range(100)]
    capacity.wait_for(waiters[0], {"slow"})  # first in, but its lane stays full
    for event in waiters[1:]:
        capacity.wait_for(event, {"fast"})

    def woken() -> list[int]:
        return [i for i, e in enumerate(waiters) if e.is_set()]

    assert woken() == []
    capacity.release("fast")  # one slot: one wake-up, the first that fits (not all 100)
    assert woken() == [1]
    capacity.wait_for(waiters[2], {"fast", "slow"})  # queued already: keeps its place
    assert woken() == [1]  # the one free slot is waiter 1's to take
    capacity.stop_waiting(waiters[1])  # woken, stops waiting without it: it passes to the next
    assert woken() == [1, 2]
    assert capacity.try_acquire("fast")  # a dispatcher not queued takes it first
    capacity.release("slow")
    assert woken() == [1, 2]  # waiter 2 has not looked yet
    capacity.wait_for(waiters[2], {"fast"})  # it looked, found none: the slow lane's first
    assert woken() == [0, 1, 2]


async def test_many_runs_over_few_slots_all_finish_without_a_wake_up_storm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sets = 0

    class Counted(asyncio.Event):
        def set(self) -> None:
            nonlocal sets
            sets += 1
            super().set()

    monkeypatch.setattr(asyncio, "Event", Counted)
    capacity = Capacity(total=2, lanes={"slow": 1})

    async def execute(task_id: str) -> bool:
        await asyncio.sleep(0.001)
        return True

    async def one_run(r: int) -> int:
        nodes = [Node(f"r{r}.s", "slow"), *(Node(f"r{r}.f{i}", "fast") for i in range(2))]
        out = await dispatch(nodes, execute, max_parallel=3, capacity=capacity)
        return len(out.done)

    runs = [asyncio.create_task(one_run(r)) for r in range(60)]
    assert await asyncio.wait_for(asyncio.gather(*runs), 20) == [3] * 60
    assert capacity.busy == 0
    assert not capacity.lane_busy["slow"]
    # A set per finished task (its own dispatcher), about one per freed slot: 180 tasks. Waking
    # every queued dispatcher on each release made it thousands.
    assert sets <= 3 * 180


async def test_failure_stops_or_skips_dependants() -> None:
    async def execute(task_id: str) -> bool:
        await asyncio.sleep(0)
        return task_id != "a"

    nodes = [Node("a", "x"), Node("b", "x", ("a",)), Node("c", "x", ("b",)), Node("d", "x")]
    skipped: list[str] = []

    async def on_skip(task_id: str, reason: str) -> None:
        skipped.append(task_id)

    out = await dispatch(nodes, execute, max_parallel=1, stop_on_failure=False, on_skip=on_skip)
    assert out.failed == {"a"}
    assert out.skipped == {"b", "c"}
    assert out.done == {"d"}
    assert sorted(skipped) == ["b", "c"]


async def test_an_exception_cancels_siblings_and_propagates() -> None:
    cancelled = asyncio.Event()

    async def execute(task_id: str) -> bool:
        if task_id == "boom":
            await asyncio.sleep(0.01)
            raise RuntimeError("boom")
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return True

    with pytest.raises(RuntimeError):
        await dispatch([Node("boom", "x"), Node("slow", "x")], execute, max_parallel=2)
    assert cancelled.is_set()


def test_levels_split_by_max_parallel() -> None:
    nodes = [Node("a", "x"), Node("b", "x"), Node("c", "x"), Node("d", "x", ("a", "b"))]
    assert levels(nodes, 2) == [["a", "b"], ["c"], ["d"]]


def test_rescue_parsing() -> None:
    assert parse_json('{"a": 1}') == ({"a": 1}, "parsed")
    assert parse_json('text ```json\n{"a": 1}\n``` more') == ({"a": 1}, "rescued_fenced")
    assert parse_json('Sure: {"a": {"b": "}"}} and {"c": 2}') == (
        {"a": {"b": "}"}},
        "rescued_object",
    )
    assert first_balanced_object("{ broken {") is None
    # an object nested in a broken one, quotes between objects, braces inside strings
    assert first_balanced_object('x {bad {"a": {"b": 2}} y}') == '{"a": {"b": 2}}'
    assert first_balanced_object('{bad} "q {"a": 1}') == '{"a": 1}'
    assert first_balanced_object('{"s": "}{"}') == '{"s": "}{"}'
    assert first_balanced_object("{" * 5000) is None  # one pass (was one scan per brace)
    deep = '{"a":' * 5000 + "1" + "}" * 5000  # past json's nesting limit: no crash
    assert first_balanced_object(deep) in (None, deep)
    with pytest.raises(ValueError):
        parse_json("no json here")


async def test_guard_retries_with_a_correction_then_gives_up() -> None:
    seen: list[list[dict[str, object]]] = []

    async def ask(messages: list[dict[str, object]], attempt: int) -> tuple[str, int | None]:
        seen.append(messages)
        return ("nope", attempt)

    with pytest.raises(GuardFailed):
        await structured("plan", [{"role": "user", "content": "x"}], ask, lambda v: v, attempts=3)
    assert len(seen) == 3
    assert "not valid" in str(seen[1][-1]["content"])


def test_assertions() -> None:
    schema = {"type": "object", "required": ["n"], "properties": {"n": {"type": "integer"}}}
    assertions = [
        {"type": "json_schema", "schema": schema},
        {"type": "contains", "text": "n"},
        {"type": "regex", "pattern": r"\d"},
        {"type": "max_length", "chars": 20},
    ]
    assert checks.check(assertions, '{"n": 3}') == []
    failures = checks.check(assertions, '{"n": "x", "pad": "................"}')
    assert len(failures) == 3
    assert checks.check([{"type": "exit_code", "code": 0}], "", exit_code=2) == [
        "the command must exit with 0 (it exited 2)"
    ]


def test_intent_coverage() -> None:
    got = checks.intent("Write a Python function parsing ISO dates", "def parse(d): dates python")
    assert got["keys"] == ["python", "function", "pars", "iso", "date"]
    assert got["missing"] == ["function", "iso"]
    assert got["coverage_ppm"] == 600_000


def test_upstream_results_are_bounded() -> None:
    block = upstream_block({f"t{i}": "x" * 50_000 for i in range(10)})
    assert len(block) < 14_000


async def test_command_timeout_kills_the_process_group() -> None:
    code = "import subprocess, time; subprocess.Popen(['sleep', '30']); time.sleep(30)"
    started = time.monotonic()
    outcome = await run_command([sys.executable, "-c", code], timeout_s=0.5)
    assert outcome.timed_out
    assert outcome.exit_code is None
    # killed with its group at the timeout, not after the children's 30 s sleeps (20: a loaded
    # machine)
    assert time.monotonic() - started < 20


async def test_command_env_is_allow_listed_and_output_capped(monkeypatch) -> None:
    monkeypatch.setenv("SECRET_TOKEN", "hunter2")
    code = "import os; print(os.environ.get('SECRET_TOKEN')); print(os.getcwd()); print('y'*9000)"
    outcome = await run_command([sys.executable, "-c", code], output_cap=4096)
    assert outcome.stdout.startswith("None\n")
    assert "tally-task-" in outcome.stdout
    assert outcome.truncated
    assert len(outcome.stdout) == 4096


async def test_held_tasks_say_which_cap_holds_them_and_the_view_shows_it() -> None:
    # A ready task held back by a cap on tasks at once once showed "pending" with no reason.
    from daemon.runs.state import RunView, TaskView
    from daemon.runs.waits import Waits
    from surfaces.cli.runs import _task_head, status_line

    capacity = Capacity(total=1, lanes={"docs": 1})
    told: list[dict[str, str]] = []
    go = asyncio.Event()
    started: list[str] = []

    async def execute(task_id: str) -> bool:
        started.append(task_id)
        await go.wait()
        return True

    waits = Waits()

    def hold(held: dict[str, str]) -> None:
        told.append(held)
        waits.hold("r1", held)

    run = asyncio.ensure_future(
        dispatch(
            [Node("a", "x"), Node("b", "x")],
            execute,
            max_parallel=4,
            capacity=capacity,
            on_hold=hold,
        )
    )
    while not started:
        await asyncio.sleep(0.01)
    held = told[-1]
    assert list(held) == ["b"]
    assert held["b"].startswith("waits for capacity: the daemon runs its most tasks at once (1")
    view = RunView(
        id="r1",
        request="q",
        request_seq=0,
        created_at_us=1,
        updated_at_us=1,
        state="running",
        tasks=[TaskView(id="a", lane="x", state="running"), TaskView(id="b", lane="x")],
    )
    shown = waits.shown(view)
    assert [t.held for t in shown.tasks] == [None, held["b"]]
    assert view.tasks[1].held is None  # the record's reduction is not changed
    line = _task_head(shown.tasks[1].model_dump())
    assert "pending (waits for capacity: the daemon runs its most tasks at once" in line
    assert "b:pending(capacity)" in status_line(shown.model_dump())
    go.set()
    assert (await asyncio.wait_for(run, 5)).done == {"a", "b"}
    assert told[-1] == {}
    assert waits.shown(view) is view  # nothing held: nothing laid over

    # a lane's cap and the run's max_parallel are named too
    told.clear()
    go.clear()
    started.clear()
    capacity = Capacity(total=8, lanes={"docs": 1})
    run = asyncio.ensure_future(
        dispatch(
            [Node("d1", "docs"), Node("d2", "docs"), Node("x1", "x"), Node("x2", "x")],
            execute,
            max_parallel=2,
            capacity=capacity,
            on_hold=told.append,
        )
    )
    while len(started) < 2:
        await asyncio.sleep(0.01)
    reasons = " | ".join(told[-1].values())
    assert "lane 'docs' runs its most tasks at once (1, the lane's max_concurrency)" in reasons
    assert "the run runs its most tasks at once (2, max_parallel)" in reasons
    go.set()
    await asyncio.wait_for(run, 5)
    assert told[-1] == {}
