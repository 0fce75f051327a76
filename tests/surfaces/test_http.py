"""HTTP surface over a fake daemon: tools, errors, auth, SSE, metrics, OpenAPI."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
from aiohttp.test_utils import TestClient
from openapi_spec_validator import validate

from daemon.errors import Busy, DeadlineExceeded
from daemon.tools import TOOLS
from surfaces.http import openapi_document
from tests.surfaces.fake import FakeDaemon

Client = TestClient[Any, Any]


async def test_tool_list_has_every_tool(client: Client) -> None:
    resp = await client.get("/v1/tools")
    assert resp.status == 200
    names = [t["name"] for t in (await resp.json())["tools"]]
    assert names == list(TOOLS)
    for required in (
        "health",
        "route",
        "plan",
        "submit",
        "run_get",
        "runs_list",
        "run_cancel",
        "run_resume",
        "ledger_verify",
        "ledger_entries",
        "ledger_get",
        "ledger_proof",
        "ledger_checkpoint",
        "causal_chain",
        "ledger_redact",
        "roster_get",
        "roster_reload",
        "slots_status",
        "ledger_summary",
    ):
        assert required in names


async def test_route_and_health(client: Client) -> None:
    resp = await client.post("/v1/tools/route", json={"text": "fix the api server"})
    assert resp.status == 200, await resp.text()
    assert (await resp.json())["lane"] == "backend"
    resp = await client.post("/v1/tools/health", json={})
    assert (await resp.json())["status"] == "ok"


async def test_invalid_input_is_422_with_errors(client: Client) -> None:
    resp = await client.post("/v1/tools/route", json={"text": ""})
    assert resp.status == 422
    body = await resp.json()
    assert body["error"]["code"] == "invalid_input"
    assert body["error"]["details"]["errors"][0]["loc"] == ["text"]
    resp = await client.post("/v1/tools/route", data=b"{not json")
    assert resp.status == 400
    resp = await client.post("/v1/tools/nope", json={})
    assert resp.status == 404
    assert (await resp.json())["error"]["code"] == "not_found"


async def test_submit_wait_returns_answer_and_run_tools(client: Client, fake: FakeDaemon) -> None:
    resp = await client.post("/v1/tools/submit", json={"request": "api", "wait": True})
    run = await resp.json()
    assert run["state"] == "done"
    assert run["answer"] == "hello world"
    got = await (await client.post("/v1/tools/run_get", json={"run_id": run["id"]})).json()
    assert got["id"] == run["id"]
    listed = await (await client.post("/v1/tools/runs_list", json={"state": "done"})).json()
    assert [r["id"] for r in listed["runs"]] == [run["id"]]
    resp = await client.post("/v1/tools/run_cancel", json={"run_id": run["id"]})
    assert resp.status == 409
    resp = await client.post("/v1/tools/run_get", json={"run_id": "missing"})
    assert resp.status == 404


async def test_ledger_tools(client: Client) -> None:
    await client.post("/v1/tools/submit", json={"request": "api", "wait": True})
    entries = await (await client.post("/v1/tools/ledger_entries", json={"bodies": True})).json()
    assert entries["size"] == len(entries["entries"]) > 3
    first = entries["entries"][0]
    assert first["content"] == {"request": "api"}
    one = await (await client.post("/v1/tools/ledger_get", json={"seq": 2})).json()
    assert one["seq"] == 2
    chain = await (await client.post("/v1/tools/causal_chain", json={"seq": 2})).json()
    assert [e["seq"] for e in chain["entries"]] == [0, 2]
    proof = await client.post("/v1/tools/ledger_proof", json={"kind": "inclusion", "seq": 1})
    assert (await proof.json())["leaf_index"] == 1
    bad = await client.post("/v1/tools/ledger_proof", json={"kind": "consistency"})
    assert bad.status == 422
    summary = await (await client.post("/v1/tools/ledger_summary", json={})).json()
    assert summary["by_kind"]["run.request"] == 1
    assert summary["verify"]["ok"]
    red = await client.post(
        "/v1/tools/ledger_redact", json={"body_hash": first["body"], "reason": "secret"}
    )
    assert (await red.json())["kind"] == "redaction"
    got = await (await client.post("/v1/tools/ledger_get", json={"seq": 0})).json()
    assert got["redacted"]
    assert got["content"] is None
    for name in (
        "ledger_verify",
        "ledger_checkpoint",
        "roster_get",
        "roster_reload",
        "slots_status",
    ):
        resp = await client.post(f"/v1/tools/{name}", json={})
        assert resp.status == 200, (name, await resp.text())


async def test_tally_errors_map_by_status(client: Client, fake: FakeDaemon, monkeypatch) -> None:
    def busy(text: str) -> None:
        raise Busy("queue full", retry_after=2.5)

    monkeypatch.setattr(fake.router, "route", busy)
    resp = await client.post("/v1/tools/route", json={"text": "x"})
    assert resp.status == 503
    assert resp.headers["Retry-After"] == "3"
    assert (await resp.json())["error"] == {"code": "busy", "message": "queue full", "details": {}}

    def late(text: str) -> None:
        raise DeadlineExceeded("too slow")

    monkeypatch.setattr(fake.router, "route", late)
    assert (await client.post("/v1/tools/route", json={"text": "x"})).status == 504

    def boom(text: str) -> None:
        raise RuntimeError("secret internals")

    monkeypatch.setattr(fake.router, "route", boom)
    resp = await client.post("/v1/tools/route", json={"text": "x"})
    assert resp.status == 500
    text = await resp.text()
    assert "secret" not in text
    assert "Traceback" not in text


async def test_auth_and_rebinding_guards(client: Client) -> None:
    url = "/v1/tools/health"
    resp = await client.post(url, json={}, headers={"Authorization": ""})
    assert resp.status == 401
    resp = await client.post(url, json={}, headers={"Authorization": "Bearer wrong"})
    assert resp.status == 401
    resp = await client.post(url, json={}, headers={"Origin": "http://evil.example"})
    assert resp.status == 403
    resp = await client.post(url, json={}, headers={"Origin": "http://localhost:3000"})
    assert resp.status == 200
    resp = await client.post(url, json={}, headers={"Host": "evil.example"})
    assert resp.status == 421
    resp = await client.post(url, json={}, headers={"Host": "127.0.0.1:1"})
    assert resp.status == 421
    resp = await client.post("/v1/tools/route", json={"text": "x" * (70 * 1024)})
    assert resp.status == 413
    assert (await resp.json())["error"]["code"] == "payload_too_large"


async def test_unix_socket_trusts_peer_without_token(
    unix_session: aiohttp.ClientSession, unix_server
) -> None:
    assert unix_server.stat().st_mode & 0o777 == 0o600
    async with unix_session.post("http://tally/v1/tools/health", json={}) as resp:
        assert resp.status == 200
    async with unix_session.get("http://evil.example/healthz") as resp:
        assert resp.status == 421


async def read_sse(resp: aiohttp.ClientResponse) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    current: dict[str, Any] = {}
    async for raw in resp.content:
        line = raw.decode().rstrip("\n")
        if not line:
            if current:
                events.append(current)
            current = {}
            continue
        if line.startswith(":"):
            continue
        key, _, value = line.partition(": ")
        current[key] = json.loads(value) if key == "data" else value
    return events


async def test_sse_streams_to_terminal_with_deltas(client: Client) -> None:
    run = await (await client.post("/v1/tools/submit", json={"request": "api"})).json()
    resp = await client.get(f"/v1/runs/{run['id']}/events")
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    events = await read_sse(resp)
    kinds = [e.get("event") for e in events]
    assert kinds[-1] == "end"
    assert "run.answer" in kinds
    assert [e["data"]["text"] for e in events if e.get("event") == "delta"] == ["hello", " world"]
    seqs = [int(e["id"]) for e in events if "id" in e]
    assert seqs == sorted(seqs)
    assert all("id" not in e for e in events if e.get("event") == "delta")


async def test_sse_resume_with_last_event_id_loses_nothing(client: Client) -> None:
    run = await (await client.post("/v1/tools/submit", json={"request": "api"})).json()
    full = [
        e for e in await read_sse(await client.get(f"/v1/runs/{run['id']}/events")) if "id" in e
    ]
    # A client that saw the first three events and reconnects gets exactly the rest.
    first = full[:3]
    resp = await client.get(
        f"/v1/runs/{run['id']}/events", headers={"Last-Event-ID": first[-1]["id"]}
    )
    rest = [e for e in await read_sse(resp) if "id" in e]
    assert [e["id"] for e in first + rest] == [e["id"] for e in full]
    assert (await client.get("/v1/runs/nope/events")).status == 404


async def test_sse_keepalive_and_shutdown_ends_stream(fake: FakeDaemon) -> None:
    from aiohttp import web

    from surfaces.http import HttpOptions, create_app
    from tests.surfaces.conftest import TOKEN

    fake.engine.step_s = 30  # the run will not move during the test
    app = create_app(fake, HttpOptions(token=TOKEN, keepalive_s=0.05))  # type: ignore[arg-type]
    runner = web.AppRunner(app, shutdown_timeout=5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    run = await fake.engine.submit("api")
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as s:
        resp = await s.get(f"http://127.0.0.1:{port}/v1/runs/{run.id}/events")
        seen = b""
        while b": keep-alive" not in seen:
            seen += await asyncio.wait_for(resp.content.readany(), 2)
        t0 = asyncio.get_running_loop().time()
        await runner.cleanup()
        assert asyncio.get_running_loop().time() - t0 < 2
        resp.close()
    await fake.stop()


async def test_metrics_text(client: Client) -> None:
    await client.post("/v1/tools/submit", json={"request": "api", "wait": True})
    text = await (await client.get("/metrics")).text()
    assert 'tally_runs{state="done"} 1' in text
    assert 'tally_slots{member="tiny",state="idle"} 2' in text
    assert "tally_ledger_fsync_seconds_bucket" in text
    assert "tally_model_calls_total 2" in text


async def test_openapi_document_validates(client: Client) -> None:
    doc = await (await client.get("/openapi.json")).json()
    assert doc["openapi"] == "3.1.0"
    validate(doc)
    assert set(TOOLS) <= {p.rsplit("/", 1)[-1] for p in doc["paths"]}
    assert openapi_document() == doc


async def test_healthz(client: Client) -> None:
    assert (await (await client.get("/healthz")).json())["status"] == "ok"


async def test_plan_tool_waves_and_problems(client: Client) -> None:
    def task(i: str, needs: list[str]) -> dict[str, Any]:
        return {"id": i, "lane": "backend", "instruction": "x", "needs": needs}

    ok = {"plan": {"tasks": [task("A", []), task("B", ["A"]), task("C", ["A"])]}}
    body = await (await client.post("/v1/tools/plan", json=ok)).json()
    assert body["ok"]
    assert body["waves"] == [["A"], ["B", "C"]]
    cyc = {"plan": {"tasks": [task("A", ["B"]), task("B", ["A"])]}}
    body = await (await client.post("/v1/tools/plan", json=cyc)).json()
    assert not body["ok"]
    assert "cycle" in {p["code"] for p in body["problems"]}
