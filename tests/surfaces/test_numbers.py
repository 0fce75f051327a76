"""Every number a client or a roster can send is finite and bounded, and nothing is coerced.

Regressions of issue 10: `budget.wall_s: 1e308` was a 500 (the wall clock overflowed into
int), a task's `timeout_s: Infinity` was accepted, `{"kind": "inclusion", "seq": false}`
proved leaf 0, `bodies: 0` was taken as false. Bodies are sent as raw bytes, because NaN and
Infinity are not JSON and no JSON encoder writes them; pydantic's parser reads them anyway.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from daemon.service import Daemon
from daemon.tools import TOOLS
from roster import Roster, RosterError, load_roster_text
from tests.roster.conftest import GOOD

Client = TestClient[Any, Any]

NOT_FINITE = ["1e308", "1e400", "-1e400", "Infinity", "-Infinity", "NaN", "-0", "-0.0"]
HUGE_INTS = [str(2**53), str(2**64), "1" + "0" * 40, "1e20"]


def task(**extra: Any) -> str:
    body = {"id": "T1", "lane": "backend", "instruction": "x", **extra}
    return json.dumps({"request": "x", "plan": {"tasks": [body]}})


def cases() -> list[tuple[str, str]]:
    found: list[tuple[str, str]] = []
    for n in NOT_FINITE:
        found += [
            ("submit", f'{{"request": "x", "budget": {{"wall_s": {n}}}}}'),
            ("submit", f'{{"request": "x", "timeout_s": {n}}}'),
            ("submit", task().replace('"instruction"', f'"timeout_s": {n}, "instruction"')),
        ]
    for n in HUGE_INTS:
        found += [
            ("submit", f'{{"request": "x", "budget": {{"tokens": {n}}}}}'),
            ("submit", f'{{"request": "x", "budget": {{"model_calls": {n}}}}}'),
            ("submit", f'{{"request": "x", "max_parallel": {n}}}'),
            ("ledger_get", f'{{"seq": {n}}}'),
            ("ledger_entries", f'{{"start": {n}}}'),
            ("ledger_proof", f'{{"kind": "consistency", "old": {n}}}'),
            ("causal_chain", f'{{"seq": {n}}}'),
            ("runs_list", f'{{"limit": {n}}}'),
        ]
    return found


@pytest.mark.parametrize(("tool", "raw"), cases())
async def test_overflow_nan_infinity_and_huge_ints_are_422(
    client: Client, daemon: Daemon, tool: str, raw: str
) -> None:
    size = daemon.ledger.size
    resp = await client.post(f"/v1/tools/{tool}", data=raw.encode())
    body = await resp.json()
    assert resp.status == 422, (raw, body)
    # A number a plan cannot hold is one of its problems, reported with the others.
    in_plan = '"plan"' in raw
    assert body["error"]["code"] == ("invalid_plan" if in_plan else "invalid_input")
    assert daemon.ledger.size == size  # nothing witnessed, nothing started
    assert daemon.engine.list() == []


@pytest.mark.parametrize(
    ("tool", "raw"),
    [
        ("ledger_proof", '{"kind": "inclusion", "seq": false}'),  # was: the proof of leaf 0
        ("ledger_proof", '{"kind": "inclusion", "seq": true}'),
        ("ledger_proof", '{"kind": "inclusion"}'),
        ("ledger_proof", '{"kind": "inclusion", "seq": 0, "old": 1}'),
        ("ledger_proof", '{"kind": "consistency", "old": 1, "seq": 0}'),
        ("ledger_entries", '{"bodies": 0}'),  # was: taken as false
        ("ledger_entries", '{"limit": "5"}'),
        ("ledger_entries", '{"limit": 5.5}'),
        ("ledger_get", '{"seq": "0"}'),
        ("ledger_checkpoint", '{"create": "true"}'),
        ("ledger_verify", '{"deep": 1}'),
        ("submit", '{"request": 1}'),
        ("submit", '{"request": "x", "wait": "yes"}'),
        ("submit", '{"request": " \\n\\t "}'),  # blank
        ("submit", '{"request": "x", "lane": ""}'),
        ("submit", task(argv=[])),  # argv needs minItems 1, as the schema says
        ("submit", task(assertions=[{"text": "no type"}])),  # the tag is required
        ("submit", task(assertions=[{"type": "max_length", "chars": True}])),
        ("submit", task(needs="T0")),
        ("route", ""),  # a required body is required
        ("route", "{}"),
        ("run_get", ""),
    ],
)
async def test_no_coercion(client: Client, daemon: Daemon, tool: str, raw: str) -> None:
    size = daemon.ledger.size
    resp = await client.post(f"/v1/tools/{tool}", data=raw.encode())
    assert resp.status == 422, (raw, await resp.text())
    assert daemon.ledger.size == size


async def test_what_json_schema_allows_is_accepted(client: Client, daemon: Daemon) -> None:
    await client.post("/v1/tools/route", json={"text": "the api"})  # entry 0
    for raw, seq in [('{"seq": -0}', 0), ('{"seq": 0.0}', 0), ('{"seq": 0e3}', 0)]:
        resp = await client.post("/v1/tools/ledger_get", data=raw.encode())
        assert resp.status == 200, raw  # -0 and 0.0 are the integer 0 in JSON Schema
        assert (await resp.json())["seq"] == seq
    resp = await client.post("/v1/tools/ledger_entries", data=b'{"limit": 1e3}')
    assert resp.status == 200
    resp = await client.post("/v1/tools/health", data=b"")  # no required field: empty is {}
    assert resp.status == 200
    # The largest allowed numbers do not overflow anything either.
    big = {"model_calls": 1_000_000, "tokens": 2**53 - 1, "wall_s": 30 * 86_400}
    resp = await client.post("/v1/tools/submit", json={"request": "the api", "budget": big})
    assert resp.status == 200, await resp.text()
    run = await resp.json()
    await daemon.engine.wait(run["id"])
    assert daemon.engine.get(run["id"]).state == "done"
    assert (await daemon.ledger.verify(deep=True)).ok


async def test_ledger_unsafe_json_schema_is_a_plan_problem(client: Client, daemon: Daemon) -> None:
    """A free-form JSON schema in an assertion goes into the ledger with the plan: a number
    the ledger cannot hold is reported by `plan` and refused by `submit`."""
    for value in ("NaN", "1e400", str(2**60)):
        schema = '{"const": ' + value + "}"
        plan = (
            '{"tasks": [{"id": "T1", "lane": "backend", "instruction": "x", "assertions": '
            '[{"type": "json_schema", "schema": ' + schema + "}]}]}"
        )
        resp = await client.post("/v1/tools/plan", data=f'{{"plan": {plan}}}'.encode())
        report = await resp.json()
        assert resp.status == 200
        assert report["ok"] is False
        assert report["problems"][0]["code"] == "schema"
        resp = await client.post(
            "/v1/tools/submit", data=f'{{"request": "x", "plan": {plan}}}'.encode()
        )
        assert resp.status == 422, await resp.text()
    assert daemon.engine.list() == []


def test_every_input_number_has_bounds() -> None:
    """The whole class, not the examples: every number in every input schema has both bounds."""
    from surfaces.openapi import openapi_document

    loose: list[str] = []

    def walk(node: Any, where: str) -> None:
        if isinstance(node, dict):
            bounded_by_value = "const" in node or "enum" in node
            if (
                node.get("type") in ("integer", "number")
                and not bounded_by_value
                and not (
                    ("minimum" in node or "exclusiveMinimum" in node)
                    and ("maximum" in node or "exclusiveMaximum" in node)
                )
            ):
                loose.append(where)
            for key, value in node.items():
                walk(value, f"{where}.{key}")
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, f"{where}[{i}]")

    schemas = openapi_document()["components"]["schemas"]
    inputs = {t.input.__name__ for t in TOOLS.values()} | {
        "Plan", "Task", "Budget", "MaxLengthAssertion", "ExitCodeAssertion",
    }  # fmt: skip
    for name in inputs:
        # The oneOf shapes of ledger_proof only narrow the bounded properties.
        walk({k: v for k, v in schemas[name].items() if k != "oneOf"}, name)
    walk(Roster.model_json_schema(), "Roster")  # policy, budget, members, sampling, lanes
    assert loose == []


@pytest.mark.parametrize(
    ("old", "new", "field"),
    [
        ("max_parallel = 3", "max_parallel = 3\nbudget = { wall_s = inf }", "policy.budget.wall_s"),
        ("max_parallel = 3", "max_parallel = 3\nbudget = { wall_s = nan }", "policy.budget.wall_s"),
        (
            "max_parallel = 3",
            "max_parallel = 3\nbudget = { wall_s = 1e308 }",
            "policy.budget.wall_s",
        ),
        (
            "max_parallel = 3",
            "max_parallel = 3\nbudget = { tokens = 1e20 }",
            "policy.budget.tokens",
        ),
        ("max_parallel = 3", "max_parallel = 3\nmax_runs = 9223372036854775807", "policy.max_runs"),
        ("max_parallel = 3", "max_parallel = true", "policy.max_parallel"),
        ("threshold = 0.3", "threshold = -inf", "policy.threshold"),
        ("slots = 2", 'slots = "2"', "models[0].slots"),
        ("slots = 2", "slots = 2\nrequest_timeout_s = inf", "models[0].request_timeout_s"),
        ("slots = 2", "slots = 2\nctx = 1e30", "models[0].ctx"),
        ("seed = 42", "seed = 18446744073709551616", "models[0].sampling.seed"),
        ("temperature = 0.2", "temperature = nan", "models[0].sampling.temperature"),
        ("max_concurrency = 2", "max_concurrency = 1e9", "lanes[1].max_concurrency"),
    ],
)
def test_roster_numbers_are_finite_and_bounded(old: str, new: str, field: str) -> None:
    assert old in GOOD
    with pytest.raises(RosterError) as caught:
        load_roster_text(GOOD.replace(old, new, 1))
    assert field in [p.field for p in caught.value.problems], caught.value.problems


def test_roster_whole_floats_are_integers() -> None:
    roster = load_roster_text(GOOD.replace("slots = 2", "slots = 2.0"))
    assert roster.models[0].slots == 2
    assert type(roster.models[0].slots) is int
