"""A real request through the embedded SmolLM2 pool (the packaged default roster)."""

from __future__ import annotations

from pathlib import Path

import pytest

from daemon.config import Settings
from daemon.runs import entries as k
from daemon.service import Daemon

pytestmark = [pytest.mark.integration, pytest.mark.slow]


async def test_a_real_request_completes_and_the_ledger_verifies(tmp_path: Path) -> None:
    settings = Settings.from_env(
        state_dir=tmp_path / "state", runtime_dir=tmp_path / "run", checkpoint_interval_s=3600
    )
    daemon = Daemon(settings)
    await daemon.start()
    try:
        view = await daemon.engine.submit(
            "Write a short docstring for a function that adds two numbers.",
            lane="docs",
            budget={"model_calls": 4, "wall_s": 240},
        )
        view = await daemon.engine.wait(view.id, timeout=300)
        assert view.state == "done", view.error
        assert view.answer
        assert view.answer.strip()
        calls = await daemon.ledger.entries(limit=10_000, kind=k.MODEL_CALL, run=view.id)
        assert calls
        for entry in calls:
            body = (await daemon.ledger.body(entry.body)).value
            assert body["member"]
            assert isinstance(body["slot"], int)
        replies = await daemon.ledger.entries(limit=10_000, kind=k.MODEL_REPLY, run=view.id)
        timings = (await daemon.ledger.body(replies[0].body)).value["timings"]
        # llama.cpp reports counts and milliseconds; the ledger keeps counts and microseconds
        assert timings["predicted_n"] > 0
        assert timings["predicted_us"] > 0
        assert not any(name.endswith(("_ms", "_per_second")) for name in timings)
        assert (await daemon.ledger.verify(deep=True)).ok
    finally:
        await daemon.stop()


async def test_a_schema_task_sends_its_schema_as_response_format(tmp_path: Path) -> None:
    settings = Settings.from_env(
        state_dir=tmp_path / "state", runtime_dir=tmp_path / "run", checkpoint_interval_s=3600
    )
    schema = {
        "type": "object",
        "properties": {"title": {"type": "string", "maxLength": 40}},
        "required": ["title"],
        "additionalProperties": False,
    }
    plan = {
        "tasks": [
            {
                "id": "T1",
                "lane": "docs",
                "instruction": "Give a title for a page about rivers, as JSON.",
                "assertions": [{"type": "json_schema", "schema": schema}],
            }
        ]
    }
    daemon = Daemon(settings)
    await daemon.start()
    try:
        view = await daemon.engine.submit("a title", plan=plan, budget={"model_calls": 4})
        view = await daemon.engine.wait(view.id, timeout=300)
        assert view.state == "done", view.error
        [call, *_] = await daemon.ledger.entries(limit=100, kind=k.MODEL_CALL, run=view.id)
        request = (await daemon.ledger.body(call.body)).value["request"]
        assert request["response_format"]["json_schema"]["schema"] == schema
        assert view.tasks[0].attempts == 1  # the grammar made the first answer valid
    finally:
        await daemon.stop()
