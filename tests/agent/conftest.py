"""The agent loop's test bench: a scripted tool-calling model behind a real slot pool, a real
ledger that witnesses every step, a real project directory, and real bubblewrap for `run`."""

from __future__ import annotations

import shutil
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from daemon import record as rec
from daemon.ledger import Ledger
from daemon.record import Body
from daemon.runs import entries as k
from daemon.runs.agent import AgentLimits, AgentResult, Mode, run_agent, sandboxed
from daemon.runs.replay import replay
from daemon.runs.sandbox import Confinement
from daemon.runs.state import RunView
from daemon.slots import Pool
from roster import Lane, Member, Roster, Tiers
from roster.models import CommandPolicy
from tests.agent.model import Script, ToolServer

RUN = "r-agent"
CALC = "def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n"
TESTS = (
    "from calc import add, mul\n\n"
    "assert mul(2, 3) == 6, 'mul'\n"
    "assert add(2, 3) == 5, f'add(2, 3) gave {add(2, 3)}'\n"
    "print('all tests pass')\n"
)
TEST_ARGV = [sys.executable, "test_calc.py"]

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap missing")


def project(root: Path) -> Path:
    """A small project whose test fails: `add` subtracts."""
    root.mkdir(parents=True)
    (root / "calc.py").write_text(CALC)
    (root / "test_calc.py").write_text(TESTS)
    (root / "README.md").write_text("# calc\n")
    return root


@dataclass
class Bench:
    server: ToolServer
    pool: Pool
    ledger: Ledger
    view: Path
    state: Path
    tasks: Path
    plan_seq: int

    async def witness(self, body: Body, parent: int | None) -> int:
        entry = await self.ledger.append(
            actor=k.ACTOR, kind=body.KIND, body=body.written(), run=RUN, parent=parent
        )
        return entry.seq

    def lease(self) -> Any:
        return self.pool.lease("cheap", affinity="agent:t1")

    def runner(self, **kw: Any) -> Any:
        confinement = Confinement(hidden=(self.state,), tasks_root=self.tasks)
        policy = kw.pop("policy", CommandPolicy())
        return sandboxed(self.view, policy=policy, confinement=confinement, **kw)

    async def checks(self) -> tuple[bool, str]:
        """The task's check: the project's tests, run in the sandbox."""
        outcome = await self.runner(timeout_s=20)(TEST_ARGV)
        return outcome.exit_code == 0, outcome.stdout + outcome.stderr

    async def go(self, mode: Mode, instruction: str = "fix add", **kw: Any) -> AgentResult:
        kw.setdefault("runner", self.runner(timeout_s=20))
        kw.setdefault("limits", AgentLimits(max_steps=12, wall_s=60))
        return await run_agent(
            instruction,
            self.view,
            self.lease,
            self.witness,
            mode=mode,
            task="t1",
            parent=self.plan_seq,
            **kw,
        )

    async def steps(self) -> list[dict[str, Any]]:
        entries = await self.ledger.entries(kind=k.AGENT_STEP, run=RUN, limit=1000)
        bodies = await self.ledger.read_bodies([e.body for e in entries])
        for entry, body, previous in zip(entries, bodies, [None, *entries], strict=False):
            expected = self.plan_seq if previous is None else previous.seq
            assert entry.parent == expected, "steps chain from the task's entry, one to the next"
            assert body.state == "present"
        return [b.value for b in bodies]

    async def replayed(self) -> RunView:
        return (await replay(self.ledger, run=RUN))[RUN]


Make = Callable[..., Any]


@pytest.fixture
async def bench(tmp_path: Path) -> AsyncIterator[Make]:
    """bench(script, n_ctx=8192, props=None) -> a Bench (a fresh project, ledger and pool)."""
    made: list[Bench] = []

    async def make(script: Script, n_ctx: int = 8192, **kw: Any) -> Bench:
        root = tmp_path / f"b{len(made)}"
        server = ToolServer(script, n_ctx=n_ctx, **kw)
        await server.start()
        member = Member(name="tiny", url=server.url, slots=2)
        roster = Roster(
            models=[member],
            tiers=Tiers(ladder=["cheap"], members={"cheap": ["tiny"]}),
            lanes=[Lane(name="x", keywords=["x"], tier="cheap", system="s")],
        )
        state = root / "state"
        state.mkdir(parents=True, mode=0o700)
        pool = Pool(roster, state)
        ledger = await Ledger.open(state, checkpoint_interval=None)
        # The entries a run starts with, as their record models write them (replay reads
        # them back as those models: a hand-made body that does not fit is not a run).
        asked = rec.RunRequest(
            request="fix add",
            lane=None,
            plan=None,
            budget=rec.Budget(model_calls=None, tokens=None, wall_ms=None),
            max_parallel=None,
            barrier=False,
            idempotency_key=None,
        )
        request = await ledger.append(actor=k.ACTOR, kind=asked.KIND, body=asked.written(), run=RUN)
        plan = {"tasks": [{"id": "t1", "lane": "x", "executor": "agent", "needs": []}]}
        planned_body = rec.RunPlan(
            source="client", plan=plan, waves=[["t1"]], critical_path=1, error=None
        )
        planned = await ledger.append(
            actor=k.ACTOR,
            kind=planned_body.KIND,
            body=planned_body.written(),
            run=RUN,
            parent=request.seq,
        )
        bench = Bench(
            server, pool, ledger, project(root / "view"), state, root / "tasks", planned.seq
        )
        made.append(bench)
        return bench

    yield make
    for bench in made:
        await bench.pool.stop()
        await bench.ledger.close()
        await bench.server.stop()
