"""A catastrophic-backtracking pattern costs the daemon nothing: RE2 matches in linear time."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import pytest

from daemon import patterns
from daemon.plans import PlanInvalid
from daemon.runs.executors import echo_stub
from daemon.runs.state import FINAL
from daemon.service import Daemon

EVIL = r"^(a+)+$"


def test_the_classic_redos_pattern_is_linear() -> None:
    for n in (27, 1000, 100_000):
        assert not patterns.search(EVIL, "a" * n + "!")
    assert patterns.search(EVIL, "a" * 100_000)


@pytest.mark.parametrize("pattern", [r"(a)\1", r"a(?=b)", r"(?<!x)y", "a" * 1001, "a{1000}{1000}"])
async def test_patterns_re2_cannot_run_are_refused_at_submit(daemon: Daemon, pattern: str) -> None:
    plan = {
        "tasks": [
            {
                "id": "t",
                "lane": "backend",
                "instruction": "x",
                "assertions": [{"type": "regex", "pattern": pattern}],
            }
        ]
    }
    with pytest.raises((PlanInvalid, ValueError)):
        await daemon.engine.submit("x", plan=plan)


async def test_healthz_answers_while_evil_assertions_are_checked(
    daemon: Daemon, unix_session: aiohttp.ClientSession
) -> None:
    subject = "a" * 200_000 + "!"  # with `re`, 27 characters already took 4.7 s
    tasks: list[dict[str, Any]] = [
        {
            "id": f"t{i}",
            "lane": "backend",
            "instruction": subject,
            "assertions": [{"type": "regex", "pattern": EVIL}],
        }
        for i in range(8)
    ]
    daemon.engine.setting.stub = echo_stub  # the tasks answer their instruction, no model
    view = await daemon.engine.submit("evil", plan={"tasks": tasks})
    worst = 0.0
    while daemon.engine.get(view.id).state not in FINAL:
        started = time.perf_counter()
        async with unix_session.get("http://tally/healthz") as resp:
            assert resp.status == 200
        worst = max(worst, time.perf_counter() - started)
        await asyncio.sleep(0.005)
    done = await daemon.engine.wait(view.id, timeout=30)
    assert done.state == "failed"  # the pattern never matches: every rung fails its check
    # A loop blocked by the pattern would hold /healthz far longer: with `re`, 27 characters
    # took 4.7 s and these are 200,000 (1 s leaves room for a loaded machine).
    assert worst < 1.0, f"/healthz took {worst * 1000:.0f} ms while the assertions ran"


def test_schema_patterns_match_with_re2() -> None:
    from daemon.runs.checks import check

    schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": EVIL}}}
    assertion = {"type": "json_schema", "schema": schema}
    output = '{"s": "' + "a" * 100_000 + '!"}'  # with `re`, 30 characters already take seconds
    (failure,) = check([assertion], output)
    assert "does not match" in failure
    assert check([assertion], '{"s": "aaa"}') == []


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "string", "pattern": r"(a)\1"},
        {"type": "object", "patternProperties": {"^(a+)+$": {}}},
        {"type": "object", "properties": {"x": {"pattern": "a(?=b)"}}},
    ],
)
async def test_schemas_with_patterns_re2_cannot_run_are_refused(
    daemon: Daemon, schema: dict[str, Any]
) -> None:
    task = {"id": "t", "lane": "backend", "instruction": "x"}
    plan = {"tasks": [task | {"assertions": [{"type": "json_schema", "schema": schema}]}]}
    with pytest.raises((PlanInvalid, ValueError)):
        await daemon.engine.submit("x", plan=plan)
