"""An `agent` task end to end on the embedded SmolLM2 pool (the packaged default roster), on a
real workspace with real bwrap and git.

Quality aside: a 135M model may well not finish "create hello.txt containing hi". What must
hold whatever it writes: the run ends within its budget, every model call of the task is one
witnessed `agent.step` (json mode, the embedded member, chained from its attempt's start),
the run's spending counts them, and a finished task's file is right and in the patch.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from daemon.config import Settings
from daemon.runs import entries as k
from daemon.service import Daemon
from tests.workspace.repo import project

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap"),
]
CALLS = 3


async def test_the_embedded_model_drives_an_agent_task_in_a_workspace_run(
    tmp_path: Path,
) -> None:
    src = project(tmp_path / "src")
    settings = Settings.from_env(
        state_dir=tmp_path / "state",
        runtime_dir=tmp_path / "run",
        checkpoint_interval_s=3600,
        workspace_roots=(tmp_path / "src",),
    )
    daemon = Daemon(settings)
    await daemon.start()
    try:
        # The server starts before the run, so its start-up is not the run's wall budget.
        async with daemon.pool.lease("cheap"):
            pass
        plan = {
            "tasks": [
                {
                    "id": "hello",
                    "lane": "docs",
                    "instruction": "Create the file hello.txt containing hi.",
                    "executor": "agent",
                    "max_steps": 2,
                    "assertions": [{"type": "run", "argv": ["grep", "-qx", "hi", "hello.txt"]}],
                }
            ]
        }
        view = await daemon.engine.submit(
            "Say hi in a file",
            plan=plan,
            workspace=str(src),
            budget={"model_calls": CALLS, "wall_s": 180},
        )
        done = await daemon.engine.wait(view.id, timeout=240)
        assert done.state in ("done", "failed", "budget_exhausted"), done.error
        entries = await daemon.ledger.entries(limit=1000, run=view.id)
        starts = {e.seq for e in entries if e.kind == k.TASK_START}
        steps = [e for e in entries if e.kind == k.AGENT_STEP]
        bodies = [(await daemon.ledger.body(e.body)).value for e in steps]
        assert 1 <= len(steps) <= CALLS
        assert done.spent.model_calls == len(steps)  # every model call of the task is a step
        assert not [e for e in entries if e.kind == k.MODEL_CALL and e.run == view.id]
        assert done.tasks[0].steps == len(steps)
        for entry, body, before in zip(steps, bodies, [None, *steps], strict=False):
            assert body["task"] == "hello"
            assert body["mode"] == "json"
            assert body["member"] == "tiny"
            assert body["parse"] in ("parsed", "malformed")  # the grammar holds it to JSON
            first = body["step"] == 1
            assert entry.parent in starts if first else entry.parent == before.seq  # type: ignore[union-attr]
            assert body["tokens"]["prompt"] > 0
        print(
            f"embedded agent run: {done.state}, {len(steps)} steps: "
            + "; ".join(
                f"{b['tool']} {b['outcome']} ({b['tokens']['prompt']}+{b['tokens']['completion']}"
                f" tok, {b['tokens']['cached']} cached, model {b['timings']['model_us'] // 1000}"
                f" ms, step {b['timings']['step_us'] // 1000} ms)"
                for b in bodies
            )
        )
        if done.state == "done":
            _, patch = await daemon.engine.patch(view.id)
            assert patch is not None
            assert "+hi" in patch.patch
        assert (await daemon.ledger.verify(deep=True)).ok
    finally:
        await daemon.stop()
