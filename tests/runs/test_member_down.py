"""A run against an external member that is not there: it fails at once with the members
named, or climbs to a tier that can serve; never waits out its wall budget. The real daemon
(ledger, pool, engine) on real sockets: a closed port and the scripted model server."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import pytest

from daemon.runs import entries as k
from daemon.service import Daemon
from daemon.slots.process import free_port
from surfaces.metrics import render
from tests.runs.model_server import ScriptedServer, settings_for

LANE = """
[[lanes]]
name = "backend"
keywords = ["backend"]
tier = "cheap"
system = "You do backend work."
"""


def roster(tiny_url: str, big_url: str) -> str:
    return f"""version = 1
[policy.budget]
wall_s = 600

[[models]]
name = "tiny"
url = "{tiny_url}"
model_id = "qwen2.5:7b"

[[models]]
name = "big"
url = "{big_url}"
slots = 2

[tiers]
ladder = ["cheap", "capable"]
cheap = ["tiny"]
capable = ["big"]
{LANE}"""


def closed() -> str:
    return f"http://127.0.0.1:{free_port()}/v1"


async def test_a_run_on_members_that_are_down_fails_at_once_naming_them(tmp_path: Path) -> None:
    tiny, big = closed(), closed()
    daemon = Daemon(settings_for(tmp_path, roster(tiny, big)))
    await daemon.start()
    try:
        started = time.monotonic()
        view = await daemon.engine.submit("fix the backend")
        view = await daemon.engine.wait(view.id, timeout=15)
        assert time.monotonic() - started < 15
        assert view.state == "failed", view.state
        assert view.error is not None
        assert "big is unreachable" in view.error  # the last rung tried, and why
        assert "connection refused" in view.error
        results = [
            (await daemon.ledger.body(e.body)).value
            for e in await daemon.ledger.entries(limit=10_000, kind=k.TASK_RESULT, run=view.id)
        ]
        first = results[0]["error"]  # the first attempt climbed the whole ladder
        for name, url in (("tiny", tiny), ("big", big)):
            assert f"{name} is unreachable" in first
            assert url.removesuffix("/v1") in first
        pool = await daemon.ledger.entries(limit=10_000, actor="pool")
        kinds = [e.kind for e in pool]
        assert kinds.count("slot.unhealthy") == 2
        assert "slot.restarting" not in kinds
        text = render(daemon)
        assert 'tally_member_healthy{member="tiny"} 0' in text
        assert 'tally_member_unhealthy_total{member="big"} 1' in text
    finally:
        await daemon.stop()


async def test_a_run_climbs_past_a_tier_whose_member_is_down(tmp_path: Path) -> None:
    server = ScriptedServer([], default="done")
    await server.start()
    daemon = Daemon(settings_for(tmp_path, roster(closed(), server.url)))
    await daemon.start()
    try:
        view = await daemon.engine.submit("fix the backend")
        view = await daemon.engine.wait(view.id, timeout=15)
        assert view.state == "done", view.error
        calls = [
            (await daemon.ledger.body(e.body)).value
            for e in await daemon.ledger.entries(limit=10_000, kind=k.MODEL_CALL, run=view.id)
        ]
        assert calls
        assert {c["member"] for c in calls} == {"big"}
        assert calls[0]["target"] == "cheap"  # asked of cheap, served by the rung above
        failovers = [
            (await daemon.ledger.body(e.body)).value
            for e in await daemon.ledger.entries(limit=10_000, kind="slot.failover")
        ]
        assert [(f["member"], f["detail"]["to_tier"]) for f in failovers] == [("tiny", "capable")]
        status = daemon.pool.status()
        cheap = next(t for t in status.tiers if t.name == "cheap")
        assert cheap.failovers >= 1
        assert 'tally_tier_failovers_total{tier="cheap"}' in render(daemon)
    finally:
        await daemon.stop()
        await server.stop()


async def test_a_member_that_comes_back_serves_runs_again(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}/v1"
    daemon = Daemon(settings_for(tmp_path, roster(url, url)))
    await daemon.start()
    server = ScriptedServer([], default="back again")
    try:
        view = await daemon.engine.wait((await daemon.engine.submit("fix the backend")).id, 15)
        assert view.state == "failed"
        await server.start(port)  # the same port, later
        deadline = time.monotonic() + 20  # the probe backs off up to probe_max_s (15 s)
        while not all(m.healthy for m in daemon.pool.status().members):
            assert time.monotonic() < deadline, daemon.pool.status()
            await asyncio.sleep(0.1)
        view = await daemon.engine.wait((await daemon.engine.submit("fix the backend")).id, 15)
        assert view.state == "done", view.error
        assert view.answer is not None
        assert "back again" in view.answer
        kinds = [e.kind for e in await daemon.ledger.entries(limit=10_000, actor="pool")]
        assert kinds.count("slot.recovered") == 2
    finally:
        await daemon.stop()
        await server.stop()


async def test_start_up_warns_of_a_member_that_is_down_without_waiting_for_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server = ScriptedServer([], default="done")
    await server.start()
    tiny = closed()
    daemon = Daemon(settings_for(tmp_path, roster(tiny, server.url)))
    caplog.set_level(logging.INFO, logger="daemon.service")
    started = time.monotonic()
    await daemon.start()
    try:
        assert time.monotonic() - started < 5
        deadline = time.monotonic() + 10
        while "member check" not in caplog.text:
            assert time.monotonic() < deadline, caplog.text
            await asyncio.sleep(0.05)
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        down = [w for w in warnings if w.startswith("member check: tiny: cannot connect")]
        assert len(down) == 1, warnings
        assert "start the server" in down[0]
        assert not [w for w in warnings if w.startswith("member check: big")]
        assert not server.requests  # the start-up check sends no model call
    finally:
        await daemon.stop()
        await server.stop()
