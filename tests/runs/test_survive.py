"""Runs that survive their faults: a model server lost mid-call does not fail the run (the call
is sent again, witnessed as `model.retry`, and is not a failed attempt); a failed run keeps its
done tasks' work as its answer; `retry` finishes a failed run without re-running its done
tasks; a client may choose the tier or member of one run. The real daemon (ledger, pool,
engine) on the fake model servers: in-process (a connection dropped mid-stream) and as a
spawned subprocess SIGKILLed mid-call."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from daemon.errors import InvalidInput, NotFound
from daemon.runs import entries as k
from daemon.service import Daemon
from tests.runs.model_server import ScriptedServer, roster_toml, settings_for
from tests.slots.fake_server import FakeServer


def one_member(member: str) -> str:
    # One attempt per rung: these tests are about lost calls, not informed retry.
    return f"""version = 1
[policy]
attempts_per_rung = 1

[policy.budget]
wall_s = 120

[[models]]
{member}

[tiers]
ladder = ["cheap"]
cheap = ["m"]

[[lanes]]
name = "backend"
keywords = ["backend"]
tier = "cheap"
system = "You do backend work."
"""


async def bodies(daemon: Daemon, **query: Any) -> list[dict[str, Any]]:
    found = await daemon.ledger.entries(limit=10_000, **query)
    return [(await daemon.ledger.body(e.body)).value for e in found]


def quick(daemon: Daemon, **over: Any) -> None:
    """Shorter engine options for a test (the daemon builds them from its settings)."""
    daemon.engine.setting.options = dataclasses.replace(daemon.engine.setting.options, **over)


@pytest.fixture
async def fake() -> AsyncIterator[FakeServer]:
    server = FakeServer(slots=2, n_ctx=2048)
    await server.start()
    yield server
    await server.stop()


async def test_a_connection_dropped_mid_stream_is_sent_again_and_the_run_is_done(
    tmp_path: Path, fake: FakeServer
) -> None:
    fake.crash_after = 3  # the first stream is cut after 3 tokens; the server stays up
    member = f'name = "m"\nurl = "{fake.url}/v1"\nslots = 2'
    daemon = Daemon(settings_for(tmp_path, one_member(member)))
    await daemon.start()
    try:
        quick(daemon, max_tokens=8)
        view = await daemon.engine.submit("fix the backend")
        view = await daemon.engine.wait(view.id, timeout=30)
        assert view.state == "done", view.error
        assert len(fake.requests) == 2
        [retry] = await bodies(daemon, kind=k.MODEL_RETRY, run=view.id)
        assert retry["member"] == "m"
        assert retry["lost"] == 1
        assert "SlotLost" in retry["error"]
        starts = await bodies(daemon, kind=k.TASK_START, run=view.id)
        assert [s["attempt"] for s in starts] == [1]  # a lost call is not a failed attempt
        [verdict] = await bodies(daemon, kind=k.TASK_VERDICT, run=view.id)
        assert verdict["ok"] is True
        replies = await bodies(daemon, kind=k.MODEL_REPLY, run=view.id)
        assert [r["error"] is None for r in replies] == [False, True]
        assert view.tasks[0].attempts == 1
        # the chain reads call → failed reply → model.retry → call → reply
        calls = await daemon.ledger.entries(limit=100, kind=k.MODEL_CALL, run=view.id)
        retried = await daemon.ledger.entries(limit=100, kind=k.MODEL_RETRY, run=view.id)
        assert calls[1].parent == retried[0].seq
    finally:
        await daemon.stop()


async def test_a_member_that_stays_lost_fails_the_run_naming_it_and_what_to_do(
    tmp_path: Path, fake: FakeServer
) -> None:
    fake.dying = "cut"  # cut mid-body, then 502 for ever
    member = f'name = "m"\nurl = "{fake.url}/v1"\nslots = 2'
    daemon = Daemon(settings_for(tmp_path, one_member(member)))
    await daemon.start()
    try:
        quick(daemon, lost_call_retries=2, lost_call_wait_s=2.0)
        started = time.monotonic()
        view = await daemon.engine.submit("fix the backend")
        view = await daemon.engine.wait(view.id, timeout=60)
        assert time.monotonic() - started < 30
        assert view.state == "failed"
        assert view.error is not None
        assert "lost 3 times on m: check its server" in view.error
        assert "m failed in flight: " in view.error
        assert f"tally retry {view.id}" in view.error
        retries = await bodies(daemon, kind=k.MODEL_RETRY, run=view.id)
        assert [r["lost"] for r in retries] == [1, 2]
    finally:
        await daemon.stop()


async def test_a_spawned_member_sigkilled_mid_call_restarts_and_the_run_is_done(
    tmp_path: Path,
) -> None:
    command = (
        '["{python}", "-m", "tests.slots.fake_server", "--port", "{port}", "--slots", '
        '"{slots}", "--ctx", "{ctx}", "--token-delay", "0.05"]'
    )
    member = f'name = "m"\ncommand = {command}\nslots = 1\nctx = 1024'
    daemon = Daemon(settings_for(tmp_path, one_member(member)))
    await daemon.start()
    try:
        quick(daemon, max_tokens=40, lost_call_wait_s=30.0)
        view = await daemon.engine.submit("fix the backend")
        killed = None
        for _ in range(400):  # the call is out: its model.call is witnessed, tokens flow
            status = daemon.pool.status().member("m")
            live = daemon.engine.get(view.id)
            if status and status.instances and status.instances[0].pid and live.spent.model_calls:
                await asyncio.sleep(0.4)  # a few tokens in
                killed = status.instances[0].pid
                os.kill(killed, signal.SIGKILL)
                break
            await asyncio.sleep(0.05)
        assert killed is not None
        view = await daemon.engine.wait(view.id, timeout=60)
        assert view.state == "done", view.error
        retries = await bodies(daemon, kind=k.MODEL_RETRY, run=view.id)
        assert len(retries) >= 1
        assert retries[0]["member"] == "m"
        status = daemon.pool.status().member("m")
        assert status is not None
        assert status.instances[0].pid not in (None, killed)  # a new server answered
        assert [s["attempt"] for s in await bodies(daemon, kind=k.TASK_START)] == [1]
    finally:
        await daemon.stop()


def two_tasks() -> dict[str, Any]:
    return {
        "tasks": [
            {"id": "T1", "lane": "docs", "instruction": "write the docs page"},
            {
                "id": "T2",
                "lane": "backend",
                "instruction": "build the backend handler",
                "needs": ["T1"],
                "assertions": [{"type": "contains", "text": "PASS"}],
            },
        ]
    }


async def test_a_failed_run_keeps_its_partial_work_and_retry_finishes_it(
    tmp_path: Path,
) -> None:
    server = ScriptedServer(
        [
            ("write the docs page", "the docs are written", 0.0),
            ("build the backend handler", ["wrong", "still wrong", "PASS: handler"], 0.0),
        ],
        default="summary",
    )
    await server.start()
    daemon = Daemon(settings_for(tmp_path, roster_toml(server.url, attempts_per_rung=1)))
    await daemon.start()
    try:
        first = await daemon.engine.submit("two things", plan=two_tasks())
        first = await daemon.engine.wait(first.id, timeout=30)
        assert first.state == "failed"
        assert first.answer is not None
        assert "the docs are written" in first.answer  # the done task's work is shown
        [partial] = await bodies(daemon, kind=k.ANSWER, run=first.id)
        assert partial["source"] == "partial"
        assert "T2" in partial["error"]

        def asked(needle: str) -> int:
            return sum(
                1
                for body in server.requests
                if any(needle in str(m.get("content")) for m in body.get("messages", []))
            )

        assert asked("write the docs page") == 1
        assert asked("build the backend handler") == 2

        again = await daemon.engine.retry(first.id, client="owner")
        assert again.id != first.id
        assert again.retry_of == first.id
        again = await daemon.engine.wait(again.id, timeout=30)
        assert again.state == "done", again.error
        assert asked("write the docs page") == 1  # T1 was not run again
        assert asked("build the backend handler") == 3
        t1 = again.task("T1")
        assert t1 is not None
        assert (t1.state, t1.reused_from, t1.attempts) == ("done", first.id, 0)
        assert again.answer is not None
        assert "the docs are written" in again.answer
        assert "PASS: handler" in again.answer
        [request] = await bodies(daemon, kind=k.REQUEST, run=again.id)
        assert request["retry_of"] == {"run": first.id, "state": "failed", "reuse": ["T1"]}
        [reuse] = await bodies(daemon, kind=k.TASK_REUSE, run=again.id)
        assert reuse["from_run"] == first.id
        assert reuse["from_seq"] == first.task("T1").verdict_seq  # type: ignore[union-attr]
        # replay rebuilds the retried run as it ran
        from daemon.runs.replay import replay

        replayed = (await replay(daemon.ledger, run=again.id))[again.id]
        assert replayed.task("T1") == again.task("T1")
        # only a stopped run that did not finish is retried
        with pytest.raises(Exception, match="only a failed, cancelled"):
            await daemon.engine.retry(again.id)
        with pytest.raises(NotFound):
            await daemon.engine.retry("rnosuchrun000000")
    finally:
        await daemon.stop()
        await server.stop()


async def test_a_run_out_of_budget_answers_with_the_work_it_did(tmp_path: Path) -> None:
    server = ScriptedServer([("write the docs page", "the docs are written", 0.0)], "x")
    await server.start()
    daemon = Daemon(settings_for(tmp_path, roster_toml(server.url, attempts_per_rung=1)))
    await daemon.start()
    try:
        view = await daemon.engine.submit("two things", plan=two_tasks(), budget={"model_calls": 1})
        view = await daemon.engine.wait(view.id, timeout=30)
        assert view.state == "budget_exhausted"
        assert view.answer is not None
        assert "## T1 (docs)" in view.answer
        assert "the docs are written" in view.answer
        [answer] = await bodies(daemon, kind=k.ANSWER, run=view.id)
        assert (answer["source"], answer["error"]) == ("partial", "budget exhausted: model_calls")
        again = await daemon.engine.retry(view.id)  # with the same budget: T2 gets its call
        again = await daemon.engine.wait(again.id, timeout=30)
        t1 = again.task("T1")
        assert t1 is not None
        assert t1.reused_from == view.id
    finally:
        await daemon.stop()
        await server.stop()


async def test_a_client_chooses_the_tier_or_member_of_one_run(tmp_path: Path) -> None:
    server = ScriptedServer([], default="ok")
    await server.start()
    daemon = Daemon(settings_for(tmp_path, roster_toml(server.url, attempts_per_rung=1)))
    await daemon.start()
    try:
        plain = await daemon.engine.wait((await daemon.engine.submit("the backend")).id, 20)
        on_tier = await daemon.engine.submit("the backend", tier="capable")
        on_tier = await daemon.engine.wait(on_tier.id, 20)
        on_member = await daemon.engine.submit("the backend", member="big")
        on_member = await daemon.engine.wait(on_member.id, 20)
        for view, member in ((plain, "tiny"), (on_tier, "big"), (on_member, "big")):
            assert view.state == "done", view.error
            calls = await bodies(daemon, kind=k.MODEL_CALL, run=view.id)
            assert {c["member"] for c in calls} == {member}
        [request] = await bodies(daemon, kind=k.REQUEST, run=on_tier.id)
        assert request["tier"] == "capable"
        assert "member" not in request
        [request] = await bodies(daemon, kind=k.REQUEST, run=plain.id)
        assert "tier" not in request  # the bytes a request always had
        assert "member" not in request
        assert on_member.member == "big"
        with pytest.raises(NotFound, match=r"no tier 'huge'.*cheap, capable"):
            await daemon.engine.submit("the backend", tier="huge")
        with pytest.raises(NotFound, match="no member 'nobody'"):
            await daemon.engine.submit("the backend", member="nobody")
        with pytest.raises(InvalidInput, match="not both"):
            await daemon.engine.submit("the backend", tier="cheap", member="big")
    finally:
        await daemon.stop()
        await server.stop()
