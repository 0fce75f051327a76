"""Small programming tasks, each with its own tests: one model call against tally's loop.

Every task in tests/bench/tasks/ (an instruction, a pytest file, a reference solution) runs as
a plan without a workspace: the tests are the task's `files`, the answer goes to
`solution.py` (`output_file`) and a `run` check runs pytest in the sandbox. Two ways, on each
tier of the roster (`ROSTER=FILE`, else the packaged default, the embedded model):
- (a) one call: one attempt, no retry, no climb; the tests judge it;
- (b) the loop: up to `LOOP_ATTEMPTS` attempts on the tier, each with the last failing
  check's output as feedback (informed retry).
Reported per tier and way: the pass rate, the mean attempts, the tokens, and tally's own
overhead per attempt (the run's wall time less the model calls and the checks).

First a scripted model that is right on its second try (it answers the reference solution
once its prompt holds a failure): it must reach 100% through the loop and 0% with one call.
`TASKS=N` runs only the first N tasks (all by default).

Bounded for a slow model (the embedded SmolLM2 takes minutes per call on a busy 2-core
machine): tiers with the same members are run once (the default roster's `cheap` and
`capable` are both the embedded model); each task runs both ways before the next task starts,
so both rows always cover the same tasks; `BENCH_S=N` stops starting tasks after N seconds
per tier (default: `EMBEDDED_S` on the packaged roster, none on a `ROSTER` given), and the
rows say how many of the tasks ran. A member's call is not cut at its
roster's `request_timeout_s` here (a slow reply is what is measured, not a lost call): the
bench allows a call `CALL_S` (1800 s). Each task's outcome is printed to stderr as it ends.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from daemon.config import Settings
from daemon.runs import entries as k
from daemon.service import Daemon
from daemon.workspace import record as ws
from roster.models import Budget, Lane, Roster
from tests.runs.model_server import ScriptedServer, roster_toml

TASKS = Path(__file__).with_name("tasks")
LOOP_ATTEMPTS = 3
CALL_S = 1800.0
EMBEDDED_S = 1200.0
"""`make bench` stays bounded on the embedded model: this many seconds of tasks per tier."""
FEEDBACK = "A previous attempt at this task failed"
WRONG = "```python\ndef nothing():\n    return None\n```\n"


@dataclass(frozen=True)
class Task:
    name: str
    instruction: str
    tests: str
    solution: str


@dataclass(frozen=True)
class Outcome:
    passed: bool
    attempts: int
    tokens: int
    overhead_ms: float
    wall_s: float


def load_tasks() -> list[Task]:
    found = []
    for path in sorted(TASKS.glob("*.toml")):
        data = tomllib.loads(path.read_text())
        found.append(Task(path.stem, data["instruction"], data["tests"], data["solution"]))
    limit = int(os.environ.get("TASKS") or len(found))
    return found[:limit]


def plan_for(task: Task) -> dict[str, Any]:
    pytest_argv = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider"]
    return {
        "tasks": [
            {
                "id": task.name,
                "lane": "bench",
                "instruction": f"{task.instruction}\nWrite the whole module solution.py in one "
                "fenced Python code block.",
                "files": {"test_solution.py": task.tests},
                "output_file": "solution.py",
                "assertions": [{"type": "run", "argv": pytest_argv, "timeout_s": 60}],
            }
        ]
    }


def bench_roster(base: Roster, tier: str, attempts: int) -> Roster:
    """The roster with a `bench` lane on `tier`, that tier alone on the ladder (no climb)."""
    lane = Lane(
        name="bench",
        keywords=["bench"],
        tier=tier,
        system="You write correct, complete Python code.",
    )
    # A development venv whose packages live elsewhere (a .pth file): pytest must import.
    sites = [p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()]
    command = base.policy.command.model_copy(
        update={"ro_binds": [*base.policy.command.ro_binds, *sites], "enabled": True}
    )
    policy = base.policy.model_copy(
        update={
            "attempts_per_rung": attempts,
            "command": command,
            "budget": Budget(model_calls=attempts, wall_s=1800),
            "judge": None,
            "coordinator": None,
        }
    )
    tiers = base.tiers.model_copy(update={"ladder": [tier]})
    lanes = [lane_ for lane_ in base.lanes if lane_.name != "bench"]
    models = [
        m.model_copy(update={"request_timeout_s": max(m.request_timeout_s, CALL_S)})
        for m in base.models
    ]
    update = {"policy": policy, "tiers": tiers, "lanes": [*lanes, lane], "models": models}
    return base.model_copy(update=update)


def distinct_tiers(roster: Roster) -> list[tuple[str, str]]:
    """(tier, label) for each tier of the ladder whose members differ from an earlier one's."""
    seen: dict[tuple[str, ...], str] = {}
    for tier in roster.tiers.ladder:
        members = tuple(sorted(roster.tiers.members.get(tier, [])))
        if members in seen:
            seen_tier = seen[members]
            seen[members] = f"{seen_tier} (= {tier})"
        else:
            seen[members] = tier
    return [(label.split(" ")[0], label) for label in seen.values()]


async def run_one(daemon: Daemon, task: Task) -> Outcome:
    view = await daemon.engine.submit(task.name, plan=plan_for(task))
    done = await daemon.engine.wait(view.id, timeout=CALL_S * LOOP_ATTEMPTS)
    found = await daemon.ledger.entries(start=done.request_seq, limit=10_000, run=view.id)
    bodies = await daemon.ledger.read_bodies([e.body for e in found])
    calls = {e.seq: e.ts for e in found if e.kind == k.MODEL_CALL}
    model_us = sum(
        e.ts - calls[e.parent] for e in found if e.kind == k.MODEL_REPLY and e.parent in calls
    )
    check_ms = sum(
        int(body.value["duration_ms"])
        for e, body in zip(found, bodies, strict=True)
        if e.kind == ws.CHECK_RUN and body.value
    )
    wall_us = found[-1].ts - found[0].ts
    attempts = max(1, done.tasks[0].attempts if done.tasks else 1)
    overhead_ms = max(0.0, (wall_us - model_us) / 1000 - check_ms) / attempts
    return Outcome(done.state == "done", attempts, done.spent.tokens, overhead_ms, wall_us / 1e6)


async def run_all(
    daemon: Daemon, base: Roster, tasks: list[Task], label: str, bound: float | None = None
) -> list[str]:
    rows = []
    ways = (("one call", 1), ("tally loop", LOOP_ATTEMPTS))
    for tier, tier_label in distinct_tiers(base):
        outcomes: dict[str, list[Outcome]] = {way: [] for way, _ in ways}
        started = time.monotonic()
        for task in tasks:
            if bound is not None and time.monotonic() - started > bound:
                break
            for way, attempts in ways:
                daemon.engine.set_roster(bench_roster(base, tier, attempts))
                outcome = await run_one(daemon, task)
                outcomes[way].append(outcome)
                print(
                    f"  {label} {tier} {way} {task.name}: "
                    f"{'pass' if outcome.passed else 'fail'}, {outcome.attempts} attempts, "
                    f"{outcome.tokens} tokens, {outcome.wall_s:.0f} s",
                    file=sys.stderr,
                    flush=True,
                )
        for way, _ in ways:
            rows.append(_row(label, tier_label, way, outcomes[way], len(tasks)))
    return rows


def _row(label: str, tier: str, way: str, outcomes: list[Outcome], total: int) -> str:
    if not outcomes:
        return f"| {label} | {tier} | {way} | no task ran within the bound | - | - | - | - |"
    passed = sum(o.passed for o in outcomes)
    ran = f" of {len(outcomes)} run" if len(outcomes) < total else ""
    return (
        f"| {label} | {tier} | {way} | {100 * passed / len(outcomes):.0f}% ({passed}/"
        f"{len(outcomes)}{ran}) | {statistics.mean(o.attempts for o in outcomes):.2f} | "
        f"{sum(o.tokens for o in outcomes)} | "
        f"{statistics.median(o.overhead_ms for o in outcomes):.0f} | "
        f"{statistics.median(o.wall_s for o in outcomes):.0f} |"
    )


class SecondTry(ScriptedServer):
    """Wrong first; the reference solution once the prompt holds the failing check."""

    def __init__(self, tasks: list[Task]) -> None:
        super().__init__([])
        self.tasks = tasks

    def _reply(self, body: dict[str, Any]) -> tuple[str, float]:
        users = [m for m in body.get("messages", []) if m.get("role") == "user"]
        text = str(users[-1].get("content", "")) if users else ""
        for task in self.tasks:
            if task.instruction in text:
                if FEEDBACK in text:
                    return f"```python\n{task.solution}```\n", 0.0
                return WRONG, 0.0
        return WRONG, 0.0


async def scripted(tasks: list[Task], root: Path) -> list[str]:
    server = SecondTry(tasks)
    await server.start()
    roster_file = root / "scripted.toml"
    roster_file.write_text(roster_toml(server.url))
    daemon = Daemon(_settings(root / "scripted", roster_file))
    await daemon.start()
    try:
        base = daemon.engine.roster
        one_tier = base.model_copy(
            update={"tiers": base.tiers.model_copy(update={"ladder": base.tiers.ladder[:1]})}
        )
        rows = await run_all(daemon, one_tier, tasks, "scripted (right on try 2)")
    finally:
        await daemon.stop()
        await server.stop()
    one, loop = rows
    assert "| 0% " in one, f"one call must pass nothing: {one}"
    assert "| 100% " in loop, f"the loop must pass everything: {loop}"
    return rows


async def real(tasks: list[Task], root: Path) -> list[str]:
    given = os.environ.get("ROSTER")
    daemon = Daemon(_settings(root / "real", Path(given) if given else None))
    await daemon.start()
    try:
        label = Path(given).name if given else "default roster"
        bound = float(os.environ.get("BENCH_S") or 0) or (None if given else EMBEDDED_S)
        return await run_all(daemon, daemon.engine.roster, tasks, label, bound)
    finally:
        await daemon.stop()


def _settings(state: Path, roster: Path | None) -> Settings:
    over: dict[str, Any] = {
        "state_dir": state / "state",
        "runtime_dir": state / "run",
        "checkpoint_interval_s": 3600,
        "drain_s": 0.5,
    }
    if roster is not None:
        over["roster_path"] = roster
    return Settings.from_env(**over)


async def _main(tasks: list[Task]) -> list[str]:
    with tempfile.TemporaryDirectory(prefix="tally-bench-tasks-") as tmp:
        root = Path(tmp)
        rows = await scripted(tasks, root)
        rows += await real(tasks, root)
    return rows


def main() -> None:
    import shutil

    if shutil.which("bwrap") is None:
        print("bwrap not installed: skipped (make install installs bubblewrap)")
        return
    tasks = load_tasks()
    rows = asyncio.run(_main(tasks))
    print(f"{len(tasks)} tasks, each judged by its own pytest file in the sandbox\n")
    print(
        "| model | tier | way | pass | attempts | tokens | tally overhead ms/attempt (p50) "
        "| wall s/task (p50) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(row)


if __name__ == "__main__":
    main()
