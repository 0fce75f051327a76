"""An `agent` task end to end on the embedded SmolLM2 pool (the packaged default roster), on a
real workspace with real bwrap and git.

The 135M model finishes "create hello.txt containing hi" in the fewest steps there are, a
write and a finish, within a budget of exactly those two model calls: every model call of the
task is one witnessed `agent.step` (json mode, the embedded member, chained from its attempt's
start), the run's spending counts them, the run is done and the file is in its patch.
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
CALLS = 2


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
            budget={"model_calls": CALLS, "wall_s": 120},
        )
        done = await daemon.engine.wait(view.id, timeout=180)
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
            # the grammar holds it to JSON; a reply cut at max_tokens is closed by the rescue
            assert body["parse"] in ("parsed", "malformed", "repaired")
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
        assert done.state == "done", (done.error, [b["reply"] for b in bodies])
        assert [b["tool"] for b in bodies] == ["write_file", "finish"]
        _, patch = await daemon.engine.patch(view.id)
        assert patch is not None
        assert "+hi" in patch.patch
        assert (await daemon.ledger.verify(deep=True)).ok
    finally:
        await daemon.stop()
