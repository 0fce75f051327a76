"""The `agent` executor beside one call and the `run`-check loop, and what a step costs.

The reference is `bench_tasks`' two ways on the same tasks, model and tier (its code, reused
here): (a) one call, (b) the tally loop (informed retry, `LOOP_ATTEMPTS` attempts). The new way:
(c) the agent: the task's tests in `files`, a `run` check with pytest, `"executor": "agent"`
with `STEPS` steps; the model writes solution.py with its tools, runs the tests, and finishes
once they pass (one attempt, no climb; the run's budget is `STEPS` model calls).

Per agent step, from its `agent.step` entries: tally's own time (the step's time less the
model's and the tool's: compaction, parsing, validation, the witness), the model's time, and
the prompt-cache reuse: cached / prompt tokens as llama.cpp's `timings` report them
(`cache_n` / (`cache_n` + `prompt_n`)) over the steps from the third on. Target: ≥ 0.8 on the
embedded model (a step evaluates little more than its new tokens).

First a scripted model (`tests.agent.model.ToolServer`) that solves each task in three steps
(write the reference solution, run the tests, finish): it must pass every task; its rows give
tally's per-step cost without a real model's noise. Then the roster's first tier (`ROSTER=FILE`,
else the packaged default: the embedded model). `TASKS=N` runs the first N tasks (default 2).

    .venv/bin/python -m tests.bench bench_agent
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from daemon.runs import entries as k
from daemon.service import Daemon
from roster.models import Budget, Roster
from tests.agent.model import Script, Step, ToolServer
from tests.bench.bench_tasks import (
    LOOP_ATTEMPTS,
    Task,
    _settings,
    bench_roster,
    load_tasks,
    run_one,
)
from tests.runs.model_server import roster_toml

STEPS = 8
PYTEST = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider"]


@dataclass
class AgentOutcome:
    passed: bool
    calls: int
    tokens: int
    tally_ms: list[float]
    model_ms: list[float]
    cached: int
    evaluated: int


def agent_plan(task: Task) -> dict[str, Any]:
    return {
        "tasks": [
            {
                "id": task.name,
                "lane": "bench",
                "executor": "agent",
                "max_steps": STEPS,
                "instruction": f"{task.instruction}\nWrite the module solution.py (the tests "
                "are in test_solution.py), run the tests, then finish.",
                "files": {"test_solution.py": task.tests},
                "assertions": [{"type": "run", "argv": PYTEST, "timeout_s": 60}],
            }
        ]
    }


def agent_roster(base: Roster, tier: str) -> Roster:
    roster = bench_roster(base, tier, 1)
    budget = Budget(model_calls=STEPS, wall_s=900)
    return roster.model_copy(update={"policy": roster.policy.model_copy(update={"budget": budget})})


async def run_agent_task(daemon: Daemon, task: Task) -> AgentOutcome:
    view = await daemon.engine.submit(task.name, plan=agent_plan(task))
    done = await daemon.engine.wait(view.id, timeout=1800)
    found = await daemon.ledger.entries(start=done.request_seq, limit=10_000, kind=k.AGENT_STEP)
    bodies = [b.value for b in await daemon.ledger.read_bodies([e.body for e in found])]
    steps = [b for b in bodies if isinstance(b, dict) and b.get("task") == task.name]
    tally_ms, model_ms = [], []
    cached = evaluated = 0
    for step in steps:
        t = step["timings"]
        model_ms.append(t["model_us"] / 1000)
        tally_ms.append(max(0, t["step_us"] - t["model_us"] - t["tool_us"]) / 1000)
        if step["step"] >= 3:
            server = t.get("server") or {}
            cache_n = int(server.get("cache_n", step["tokens"]["cached"]))
            prompt_n = int(server.get("prompt_n", step["tokens"]["prompt"] - cache_n))
            cached += cache_n
            evaluated += cache_n + prompt_n
    return AgentOutcome(
        done.state == "done",
        len(steps),
        done.spent.tokens,
        tally_ms,
        model_ms,
        cached,
        evaluated,
    )


def _p50(values: list[float]) -> str:
    return f"{statistics.median(values):.1f}" if values else "-"


async def rows_for(daemon: Daemon, base: Roster, tasks: list[Task], label: str) -> list[str]:
    tier = base.tiers.ladder[0]
    rows = []
    for way, attempts in (("one call", 1), ("tally loop", LOOP_ATTEMPTS)):
        daemon.engine.set_roster(bench_roster(base, tier, attempts))
        outcomes = [await run_one(daemon, task) for task in tasks]
        passed = sum(o.passed for o in outcomes)
        rows.append(
            f"| {label} | {tier} | {way} | {passed}/{len(outcomes)} | "
            f"{statistics.mean(o.attempts for o in outcomes):.2f} | "
            f"{sum(o.tokens for o in outcomes)} | "
            f"{statistics.median(o.overhead_ms for o in outcomes):.0f} per attempt | - | - |"
        )
    daemon.engine.set_roster(agent_roster(base, tier))
    agents = [await run_agent_task(daemon, task) for task in tasks]
    passed = sum(a.passed for a in agents)
    tally = [ms for a in agents for ms in a.tally_ms]
    model = [ms for a in agents for ms in a.model_ms]
    cached = sum(a.cached for a in agents)
    evaluated = sum(a.evaluated for a in agents)
    reuse = f"{cached / evaluated:.2f} ({cached}/{evaluated})" if evaluated else "-"
    rows.append(
        f"| {label} | {tier} | agent | {passed}/{len(agents)} | "
        f"{statistics.mean(a.calls for a in agents):.2f} | {sum(a.tokens for a in agents)} | "
        f"{_p50(tally)} per step | {_p50(model)} | {reuse} |"
    )
    return rows


def solving_script(tasks: list[Task]) -> Script:
    script: Script = []
    for task in tasks:
        script += [
            Step("write_file", {"path": "solution.py", "content": task.solution}),
            Step("run", {"argv": PYTEST}),
            Step("finish", {"summary": f"{task.name} solved"}),
        ]
    return script


async def scripted(tasks: list[Task], root: Path) -> list[str]:
    server = ToolServer(solving_script(tasks))
    await server.start()
    roster_file = root / "scripted.toml"
    roster_file.write_text(roster_toml(server.url))
    daemon = Daemon(_settings(root / "scripted", roster_file))
    await daemon.start()
    try:
        base = daemon.engine.roster
        daemon.engine.set_roster(agent_roster(base, base.tiers.ladder[0]))
        agents = [await run_agent_task(daemon, task) for task in tasks]
    finally:
        await daemon.stop()
        await server.stop()
    assert all(a.passed and a.calls == 3 for a in agents), "the scripted agent solves each task"
    tally = [ms for a in agents for ms in a.tally_ms]
    model = [ms for a in agents for ms in a.model_ms]
    return [
        f"| scripted (solves in 3 steps) | cheap | agent | {len(agents)}/{len(agents)} | 3.00 | "
        f"{sum(a.tokens for a in agents)} | {_p50(tally)} per step | {_p50(model)} | - |"
    ]


async def real(tasks: list[Task], root: Path) -> list[str]:
    given = os.environ.get("ROSTER")
    daemon = Daemon(_settings(root / "real", Path(given) if given else None))
    await daemon.start()
    try:
        label = Path(given).name if given else "default roster"
        return await rows_for(daemon, daemon.engine.roster, tasks, label)
    finally:
        await daemon.stop()


async def _main(tasks: list[Task]) -> None:
    with tempfile.TemporaryDirectory(prefix="tally-bench-agent-") as tmp:
        root = Path(tmp)
        for row in await scripted(tasks, root):  # printed at once: the real model is slow
            print(row, flush=True)
        for row in await real(tasks, root):
            print(row, flush=True)


def main() -> None:
    import shutil

    if shutil.which("bwrap") is None:
        print("bwrap not installed: skipped (make install installs bubblewrap)")
        return
    os.environ.setdefault("TASKS", "2")
    tasks = load_tasks()
    print(f"{len(tasks)} tasks, each judged by its own pytest file in the sandbox\n")
    print(
        "| model | tier | way | pass | model calls | tokens | tally ms (p50) | "
        "model ms/step (p50) | cached/evaluated from step 3 |"
    )
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    asyncio.run(_main(tasks))


if __name__ == "__main__":
    main()
