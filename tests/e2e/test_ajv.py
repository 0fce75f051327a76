"""Ajv (npm, pinned in tests/e2e/package.json) in strict mode compiles every input and output
schema that /v1/tools and the MCP tools/list publish: plain JSON Schema 2020-12, no OpenAPI
keywords such as `discriminator`. On sample instances Ajv and the server agree: what the
schema accepts the server accepts, what it refuses the server refuses (no coercion)."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from pydantic import ValidationError

from daemon.tools import TOOLS
from tests.surfaces.mcp_client import session_for

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests/e2e/ajv_strict.cjs"
AJV = ROOT / "tests/e2e/node_modules/ajv-formats"

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        not AJV.exists() or shutil.which("node") is None, reason="run `make install` for Ajv"
    ),
]

PLAN = {"tasks": [{"id": "T1", "lane": "backend", "instruction": "x"}]}

# (tool, arguments): each is checked by Ajv against the published input schema and by the
# server's own validation; the two verdicts must be equal.
SAMPLES: list[tuple[str, Any]] = [
    ("ledger_proof", {"kind": "inclusion", "seq": 0}),
    ("ledger_proof", {"kind": "inclusion", "seq": 3, "size": 5}),
    ("ledger_proof", {"kind": "consistency", "old": 1}),
    ("ledger_proof", {"kind": "consistency", "old": 1, "new": 2}),
    ("ledger_proof", {"kind": "inclusion", "seq": False}),
    ("ledger_proof", {"kind": "inclusion"}),
    ("ledger_proof", {"kind": "inclusion", "seq": None}),
    ("ledger_proof", {"kind": "inclusion", "seq": 0, "old": 1}),
    ("ledger_proof", {"kind": "consistency", "old": 1, "size": 2}),
    ("ledger_proof", {"kind": "consistency"}),
    ("ledger_entries", {"bodies": 0}),
    ("ledger_entries", {"bodies": True, "limit": 10}),
    ("ledger_entries", {"limit": 10.0}),
    ("ledger_entries", {"limit": 10.5}),
    ("ledger_entries", {"limit": "10"}),
    ("ledger_entries", {"start": 2**53}),
    ("ledger_get", {"seq": 0}),
    ("ledger_get", {}),
    ("health", {}),
    ("health", {"x": 1}),
    ("route", {"text": ""}),
    ("route", {"text": "a"}),
    ("submit", {"request": "x"}),
    ("submit", {"request": " \n"}),
    ("submit", {"request": "x", "budget": {"wall_s": 1e308}}),
    ("submit", {"request": "x", "budget": {"wall_s": 600}}),
    ("submit", {"request": "x", "budget": {"tokens": 2**53}}),
    ("submit", {"request": "x", "lane": ""}),
    ("submit", {"request": "x", "lane": "backend"}),
    ("submit", {"request": "x", "plan": PLAN}),
    ("submit", {"request": "x", "plan": {"tasks": [{**PLAN["tasks"][0], "argv": []}]}}),
    ("submit", {"request": "x", "plan": {"tasks": [{**PLAN["tasks"][0], "timeout_s": 1e9}]}}),
    (
        "plan",
        {
            "plan": {
                "tasks": [{**PLAN["tasks"][0], "assertions": [{"type": "contains", "text": "a"}]}]
            }
        },
    ),
    ("plan", {"plan": {"tasks": [{**PLAN["tasks"][0], "assertions": [{"text": "a"}]}]}}),
    (
        "plan",
        {
            "plan": {
                "tasks": [{**PLAN["tasks"][0], "assertions": [{"type": "regex", "pattern": "["}]}]
            }
        },
    ),
    (
        "plan",
        {
            "plan": {
                "tasks": [{**PLAN["tasks"][0], "assertions": [{"type": "exit_code", "code": 256}]}]
            }
        },
    ),
    ("plan", {"plan": {"tasks": []}}),
    ("runs_list", {"state": "done", "limit": 5}),
    ("runs_list", {"state": "nope"}),
]


def server_accepts(tool: str, arguments: Any) -> bool:
    try:
        data = TOOLS[tool].input.model_validate_json(json.dumps(arguments))
    except ValidationError:
        return False
    # A plan that fails its schema is kept for the handler, which refuses it (422) with every
    # problem of it at once (see daemon.tools.roster._keep_a_bad_plan).
    return getattr(data, "_unchecked", None) is None


async def ajv(tmp_path: Path, schemas: list[dict[str, Any]], instances: Any = ()) -> Any:
    path = tmp_path / "ajv-input.json"
    path.write_text(json.dumps({"schemas": schemas, "instances": list(instances)}))
    proc = await asyncio.create_subprocess_exec(
        "node",
        str(SCRIPT),
        str(path),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    return json.loads(out)


async def test_ajv_strict_compiles_every_published_schema(
    unix_server: Path, tmp_path: Path
) -> None:
    conn = aiohttp.UnixConnector(path=str(unix_server))
    async with (
        aiohttp.ClientSession(connector=conn) as http,
        http.get("http://tally/v1/tools") as r,
    ):
        http_tools = (await r.json())["tools"]
    async with session_for(unix_server) as session:
        mcp_tools = (await session.list_tools()).tools
    schemas = []
    for t in http_tools:
        schemas.append({"label": f"http {t['name']} input", "schema": t["input_schema"]})
        schemas.append({"label": f"http {t['name']} output", "schema": t["output_schema"]})
    for m in mcp_tools:
        schemas.append({"label": f"mcp {m.name} input", "schema": m.input_schema})
        schemas.append({"label": f"mcp {m.name} output", "schema": m.output_schema})
    assert len(schemas) == 4 * len(TOOLS)
    report = await ajv(tmp_path, schemas)
    assert report["errors"] == []


async def test_ajv_refuses_what_the_server_used_to_publish(tmp_path: Path) -> None:
    """The control: strict Ajv does refuse an OpenAPI `discriminator` and a raw `ge`."""
    bad = [
        {
            "label": "discriminator",
            "schema": {
                "oneOf": [{"type": "object"}],
                "discriminator": {"propertyName": "type"},
            },
        },
        {"label": "ge", "schema": {"type": "integer", "ge": 0}},
    ]
    report = await ajv(tmp_path, bad)
    assert [e["label"] for e in report["errors"]] == ["discriminator", "ge"]


async def test_ajv_and_the_server_agree_on_samples(tmp_path: Path) -> None:
    schemas = [
        {"label": name, "schema": tool.input.model_json_schema(mode="validation")}
        for name, tool in TOOLS.items()
    ]
    instances = [{"label": tool, "data": args} for tool, args in SAMPLES]
    report = await ajv(tmp_path, schemas, instances)
    assert report["errors"] == []
    disagree = [
        (tool, args, verdict)
        for (tool, args), verdict in zip(SAMPLES, report["verdicts"], strict=True)
        if verdict != server_accepts(tool, args)
    ]
    assert disagree == []
    assert any(report["verdicts"])
    assert not all(report["verdicts"])
