"""A workspace run end to end on the embedded SmolLM2 pool (the packaged default roster).

Quality aside: the task's output goes to `output_file`, so whatever the model writes makes a
valid patch; the point is the whole path with a real model server, real bwrap and real git.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from daemon.config import Settings
from daemon.service import Daemon
from daemon.workspace import record as ws
from tests.workspace.repo import BUGGY, git, project

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap"),
]


async def test_the_embedded_model_completes_a_workspace_run_and_apply_accepts_its_patch(
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
        plan = {
            "tasks": [
                {
                    "id": "notes",
                    "lane": "docs",
                    "instruction": "Write a short note about what calc.py does.",
                    "output_file": "NOTES.md",
                    "assertions": [{"type": "run", "argv": ["test", "-f", "NOTES.md"]}],
                }
            ]
        }
        view = await daemon.engine.submit(
            "Document calc.py",
            plan=plan,
            workspace=str(src),
            budget={"model_calls": 4, "wall_s": 240},
        )
        done = await daemon.engine.wait(view.id, timeout=300)
        assert done.state == "done", done.error
        assert done.patch_files == ["NOTES.md"]
        _, body = await daemon.engine.patch(view.id)
        assert body is not None
        assert "+++ b/NOTES.md" in body.patch
        assert not (src / "NOTES.md").exists()  # untouched until apply
        checks = await daemon.ledger.entries(limit=100, kind=ws.CHECK_RUN, run=view.id)
        assert len(checks) == 1
        assert (await daemon.engine.apply(view.id, check=True)).ok
        applied = await daemon.engine.apply(view.id)
        assert applied.method == "git-3way"
        assert (src / "NOTES.md").is_file()
        assert (src / "calc.py").read_text() == BUGGY
        assert "NOTES.md" in git(src, "status", "--porcelain")
        assert (await daemon.ledger.verify(deep=True)).ok
    finally:
        await daemon.stop()
