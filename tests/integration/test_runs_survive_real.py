"""A run on the embedded model (the xllamacpp launcher, the packaged default roster) whose
model server is SIGKILLed mid-answer: the pool restarts it, the call is sent again
(`model.retry`), and the run ends done, with one attempt."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from daemon.config import Settings
from daemon.runs import entries as k
from daemon.service import Daemon

pytestmark = [pytest.mark.integration, pytest.mark.slow]


async def test_a_real_server_killed_mid_answer_restarts_and_the_run_is_done(
    tmp_path: Path,
) -> None:
    settings = Settings.from_env(
        state_dir=tmp_path / "state", runtime_dir=tmp_path / "run", checkpoint_interval_s=3600
    )
    daemon = Daemon(settings)
    await daemon.start()
    try:
        view = await daemon.engine.submit(
            "Write a long, detailed tutorial on documenting a Python package.",
            lane="docs",
            budget={"model_calls": 6, "wall_s": 400},
        )
        killed = None
        for _ in range(3000):  # the call is out and the model writing: kill its server
            status = daemon.pool.status().member("tiny")
            live = daemon.engine.get(view.id)
            pid = status.instances[0].pid if status and status.instances else None
            if pid and live.spent.model_calls and live.spent.tokens == 0:
                await asyncio.sleep(0.3)
                if daemon.engine.get(view.id).spent.tokens == 0:  # no reply yet
                    killed = pid
                    os.kill(pid, signal.SIGKILL)
                    break
            await asyncio.sleep(0.05)
        assert killed is not None
        view = await daemon.engine.wait(view.id, timeout=400)
        assert view.state == "done", view.error
        retries = await daemon.ledger.entries(limit=100, kind=k.MODEL_RETRY, run=view.id)
        assert retries
        body = (await daemon.ledger.body(retries[0].body)).value
        assert body["member"] == "tiny"
        assert [t.attempts for t in view.tasks] == [1]
        status = daemon.pool.status().member("tiny")
        assert status is not None
        assert status.instances[0].pid not in (None, killed)
    finally:
        await daemon.stop()
