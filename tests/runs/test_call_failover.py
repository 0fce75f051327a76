"""A run whose member dies under a model call: the call moves to the tier's other member and
the run succeeds, witnessed (`slot.failover` naming both, the reply naming where it ran) and
visible (`tally slots`, /metrics); with no member left the run fails soon (after its bounded
resends), naming them. The real daemon (ledger, pool, engine) on the scripted model server."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from daemon.runs import entries as k
from daemon.service import Daemon
from surfaces.cli.slots import _table
from surfaces.metrics import render
from tests.runs.model_server import ScriptedServer, settings_for


def roster(a_url: str, b_url: str) -> str:
    # One attempt per rung: these tests are about lost calls, not informed retry.
    return f"""version = 1
[policy]
attempts_per_rung = 1

[policy.budget]
wall_s = 600

[[models]]
name = "a"
url = "{a_url}"

[[models]]
name = "b"
url = "{b_url}"

[tiers]
ladder = ["cheap"]
cheap = ["a", "b"]

[[lanes]]
name = "backend"
keywords = ["backend"]
tier = "cheap"
system = "You do backend work."
"""


@pytest.fixture
async def servers() -> AsyncIterator[tuple[ScriptedServer, ScriptedServer]]:
    a, b = ScriptedServer([], default="from a"), ScriptedServer([], default="from b")
    await a.start()
    await b.start()
    yield a, b
    await a.stop()
    await b.stop()


async def bodies(daemon: Daemon, **query: Any) -> list[dict[str, Any]]:
    found = await daemon.ledger.entries(limit=10_000, **query)
    return [(await daemon.ledger.body(e.body)).value for e in found]


async def test_a_run_survives_its_member_dying_mid_call(
    tmp_path: Path, servers: tuple[ScriptedServer, ScriptedServer]
) -> None:
    a, b = servers
    a.dying = "cut"  # its first call is cut mid-body, and it answers nothing after
    daemon = Daemon(settings_for(tmp_path, roster(a.url, b.url)))
    await daemon.start()
    try:
        view = await daemon.engine.submit("fix the backend")
        view = await daemon.engine.wait(view.id, timeout=15)
        assert view.state == "done", view.error
        assert view.answer is not None
        assert "from b" in view.answer
        assert len(a.requests) == 1
        calls = await bodies(daemon, kind=k.MODEL_CALL, run=view.id)
        replies = await bodies(daemon, kind=k.MODEL_REPLY, run=view.id)
        assert calls[0]["member"] == "a"  # where it was sent first
        assert replies[0]["member"] == "b"  # where it was answered
        assert replies[0]["error"] is None
        assert {r["member"] for r in replies} == {"b"}
        moved = [
            f for f in await bodies(daemon, kind="slot.failover") if f["detail"].get("in_flight")
        ]
        assert len(moved) == 1
        detail = moved[0]["detail"]
        assert (detail["from_member"], detail["to_member"], detail["tier"]) == ("a", "b", "cheap")
        assert "connection failed" in detail["reason"]
        status = daemon.pool.status()
        member_a = status.member("a")
        assert member_a is not None
        assert (member_a.healthy, member_a.state) == (False, "unhealthy")
        assert "calls moved off a member that failed mid-call" in _table(status)
        text = render(daemon)
        assert 'tally_tier_in_flight_failovers_total{tier="cheap"} 1' in text
        assert 'tally_member_healthy{member="a"} 0' in text
    finally:
        await daemon.stop()


async def test_a_run_with_no_member_left_fails_at_once_naming_them(
    tmp_path: Path, servers: tuple[ScriptedServer, ScriptedServer]
) -> None:
    a, b = servers
    a.dying, b.dying = "cut", "502"
    daemon = Daemon(settings_for(tmp_path, roster(a.url, b.url)))
    await daemon.start()
    # A lost call is sent again a bounded number of times (tests/runs/test_survive.py): once
    # here, so the run fails soon, naming both members, why, and what to do.
    options = daemon.engine.setting.options
    daemon.engine.setting.options = dataclasses.replace(options, lost_call_retries=1)
    try:
        started = time.monotonic()
        view = await daemon.engine.submit("fix the backend")
        view = await daemon.engine.wait(view.id, timeout=15)
        assert time.monotonic() - started < 10  # not the 600 s wall budget
        assert view.state == "failed", view.state
        assert view.error is not None
        assert "a failed in flight: " in view.error
        assert "b failed in flight: " in view.error
        assert "502" in view.error
        assert "lost 2 times on a, b: " in view.error
        assert f"tally retry {view.id}" in view.error
        assert (len(a.requests), len(b.requests)) == (1, 1)
    finally:
        await daemon.stop()
