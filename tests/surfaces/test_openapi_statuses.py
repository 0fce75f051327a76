"""The OpenAPI document states every status an operation can answer with, and the answers
match: each status below is provoked for real and must be documented on its operation, with
an error body of the documented shape. A 405 names the allowed methods."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
from aiohttp.test_utils import TestClient

from daemon.service import Daemon
from daemon.tools import ERRORS, TOOLS
from surfaces.openapi import openapi_document

Client = TestClient[Any, Any]

DOC = openapi_document()


def documented(path: str, method: str = "post") -> set[int]:
    return {int(code) for code in DOC["paths"][path][method]["responses"]}


def check_error(status: int, body: Any, path: str, method: str = "post") -> None:
    assert status in documented(path, method), (path, status)
    schema = DOC["paths"][path][method]["responses"][str(status)]["content"]["application/json"]
    error_schema = DOC["components"]["schemas"]["Error"]
    assert schema["schema"] == {"$ref": "#/components/schemas/Error"}
    jsonschema.validate(body, error_schema)


async def test_provoked_statuses_are_documented(client: Client, daemon: Daemon) -> None:
    cases: list[tuple[str, bytes | None, dict[str, str], int]] = [
        ("route", b"{not json", {}, 400),
        ("route", b'{"text": NaN}', {}, 422),
        ("route", b"{}", {"Authorization": "Bearer wrong"}, 401),
        ("route", b"{}", {"Origin": "https://evil.example"}, 403),
        ("route", b"{}", {"Host": "evil.example"}, 421),
        ("route", b"x" * (64 * 1024 + 1), {}, 413),
        ("run_get", b'{"run_id": "nope"}', {}, 404),
        ("ledger_get", b'{"seq": 99}', {}, 404),
        ("ledger_proof", b'{"kind": "consistency", "old": 5}', {}, 404),
        ("causal_chain", b'{"seq": 99}', {}, 404),
        ("ledger_redact", json.dumps({"body_hash": "0" * 64, "reason": "x"}).encode(), {}, 404),
        ("roster_reload", b'{"path": "/nonexistent/roster.toml"}', {}, 403),  # outside
        ("submit", b'{"request": "x", "lane": "nope"}', {}, 404),
        ("run_resume", b'{"run_id": "nope"}', {}, 404),
    ]
    for tool, body, headers, status in cases:
        resp = await client.post(f"/v1/tools/{tool}", data=body, headers=headers)
        assert resp.status == status, (tool, body, await resp.text())
        check_error(status, await resp.json(), f"/v1/tools/{tool}")


async def test_idempotency_conflict_is_a_documented_409(client: Client) -> None:
    first = {"request": "the api", "idempotency_key": "k1"}
    assert (await client.post("/v1/tools/submit", json=first)).status == 200
    resp = await client.post("/v1/tools/submit", json={**first, "request": "other"})
    assert resp.status == 409
    check_error(409, await resp.json(), "/v1/tools/submit")


async def test_405_names_the_allowed_methods(client: Client) -> None:
    for method, path, allowed in [
        ("GET", "/v1/tools/route", {"POST"}),
        ("DELETE", "/v1/tools/submit", {"POST"}),
        ("PUT", "/healthz", {"GET", "HEAD"}),
        ("POST", "/openapi.json", {"GET", "HEAD"}),
        ("TRACE", "/v1/tools", {"GET", "HEAD"}),
    ]:
        resp = await client.request(method, path)
        assert resp.status == 405, (method, path)
        assert {m.strip() for m in resp.headers["Allow"].split(",")} == allowed
        body = await resp.json()
        assert body["error"]["code"] == "method_not_allowed"


def test_every_tool_operation_documents_the_common_statuses() -> None:
    for name, tool in TOOLS.items():
        op = DOC["paths"][f"/v1/tools/{name}"]["post"]
        assert {200, 400, 401, 403, 408, 413, 421, 422, 500} <= documented(f"/v1/tools/{name}")
        # A body is required exactly when the input has required fields.
        needs = bool(tool.input.model_json_schema().get("required"))
        assert op["requestBody"]["required"] is needs, name
    assert "discriminator" not in json.dumps(DOC)
    assert set(ERRORS) <= set(TOOLS)
