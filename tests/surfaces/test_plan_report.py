"""A plan's problems in one pass, the same from `tally plan`, the `plan` tool and `submit`:
the schema's (an unknown field with "did you mean", a command task without argv) together with
unknown lanes, missing needs, duplicate ids and cycles."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from daemon.plans import report
from surfaces.cli import main
from tests.surfaces.conftest import roster_toml

# Every kind of problem at once.
BAD: dict[str, Any] = {
    "tasks": [
        {"id": "A", "lane": "backend", "instruction": "a", "timeout": 5, "needs": ["B"]},
        {"id": "B", "lane": "nolane", "instruction": "b", "needs": ["A"]},
        {"id": "C", "lane": "backend", "instruction": "c", "executor": "command"},
        {
            "id": "D",
            "lane": "docs",
            "instruction": "d",
            "needs": ["Z"],
            "assertions": [{"type": "contains", "txt": "x"}],
        },
        {"id": "C", "lane": 7, "instruction": "again"},
    ]
}
EXPECTED = [
    ("schema", "tasks[0].timeout: unknown field 'timeout'; did you mean `timeout_s`?"),
    ("schema", "tasks[2]: a command task needs `argv`"),
    ("schema", "tasks[3].assertions[0].contains.text: Field required"),
    ("schema", "tasks[3].assertions[0].contains.txt: unknown field 'txt'; did you mean `text`?"),
    ("schema", "tasks[4].lane: Input should be a valid string"),
    ("duplicate_id", "task id 'C' is used 2 times (tasks[2], tasks[4])"),
    ("unknown_lane", "task 'B': unknown lane 'nolane' (known: backend, docs)"),
    ("unknown_need", "task 'D' needs 'Z', which is not a task in the plan"),
    ("cycle", "cycle: A -> B -> A (each task needs the next)"),
]


def _matches(found: list[tuple[str, str]]) -> None:
    assert len(found) == len(EXPECTED), found
    for (code, message), (want_code, want) in zip(found, EXPECTED, strict=True):
        assert code == want_code
        assert message.startswith(want), (message, want)


def test_report_names_every_problem_in_one_pass() -> None:
    plan, found = report(json.dumps(BAD), ["backend", "docs"])
    assert plan is None
    _matches([(p.code, p.message) for p in found])
    assert [p.tasks for p in found][-1] == ["A", "B", "A"]
    # A far-off unknown field lists the fields instead of guessing.
    _, found = report({"tasks": [{"id": "A", "lane": "x", "instruction": "", "zzz": 1}]})
    assert found[0].message.startswith("tasks[0].zzz: unknown field 'zzz' (the fields here: id,")
    _, found = report({"task": []})
    assert "did you mean `tasks`?" in found[-1].message
    # Another format's name for a field is matched by meaning, not spelling (`kind` is not `id`);
    # a misspelt lane gets its "did you mean" too.
    _, found = report(
        {"tasks": [{"id": "A", "lane": "bakend", "instruction": "x", "kind": "command"}]},
        ["backend", "docs"],
    )
    messages = [p.message for p in found]
    assert "tasks[0].kind: unknown field 'kind'; did you mean `executor`?" in messages, messages
    _, found = report({"tasks": [{"id": "A", "lane": "bakend", "instruction": "x"}]}, ["backend"])
    assert "unknown lane 'bakend'; did you mean `backend`?" in found[0].message


def test_tally_plan_reports_it_all_at_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    roster = tmp_path / "roster.toml"
    roster.write_text(roster_toml("http://127.0.0.1:9"))  # lanes backend and docs
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(BAD))
    assert main(["plan", str(path), "--roster", str(roster), "--json"]) == 1
    errors = json.loads(capsys.readouterr().out)["errors"]
    _matches([(e["code"], e["message"]) for e in errors])
    assert main(["plan", str(path), "--roster", str(roster)]) == 1
    assert len(capsys.readouterr().out.splitlines()) == len(EXPECTED)


async def test_the_plan_tool_and_submit_report_it_all_at_once(
    client: TestClient[Any, Any],
) -> None:
    for tool, args in (("plan", {"plan": BAD}), ("submit", {"request": "x", "plan": BAD})):
        resp = await client.post(f"/v1/tools/{tool}", json=args)
        body = await resp.json()
        assert resp.status == 422, body
        assert body["error"]["code"] == "invalid_plan"
        _matches([(e["code"], e["message"]) for e in body["error"]["details"]["errors"]])
    # Other bad arguments still fail as the schema says, before the plan is looked at.
    resp = await client.post("/v1/tools/plan", json={"plan": BAD, "max_parallel": 0})
    body = await resp.json()
    assert resp.status == 422
    assert body["error"]["code"] != "invalid_plan"
    # A sound plan is untouched by all this.
    good = {"tasks": [{"id": "A", "lane": "backend", "instruction": "a"}]}
    resp = await client.post("/v1/tools/plan", json={"plan": good})
    assert (await resp.json())["ok"] is True
