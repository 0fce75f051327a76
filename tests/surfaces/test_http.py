"""HTTP surface over the real Daemon (ledger, engine, pool → fake model server): every tool,
errors, auth, SSE, metrics, OpenAPI."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from openapi_spec_validator import validate

from daemon.errors import Busy, DeadlineExceeded, TallyError
from daemon.ledger.merkle import verify_inclusion
from daemon.runs import entries as k
from daemon.service import Daemon
from daemon.slots.errors import PoolBusy, PoolTimeout
from daemon.tools import TOOLS
from surfaces.http import HttpOptions, Listen, create_app, serve
from surfaces.openapi import openapi_document
from tests.slots.fake_server import FakeServer
from tests.surfaces.conftest import TOKEN, daemon_settings, two_tasks

Client = TestClient[Any, Any]


async def call(client: Client, tool: str, status: int = 200, **args: Any) -> Any:
    resp = await client.post(f"/v1/tools/{tool}", json=args)
    body = await resp.json()
    assert resp.status == status, (tool, resp.status, body)
    return body


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


async def test_route_is_witnessed_and_health_counts(client: Client, daemon: Daemon) -> None:
    before = daemon.ledger.size
    routed = await call(client, "route", text="fix the api server")
    assert routed["lane"] == "backend"
    assert routed["matched"]["backend"]
    assert daemon.ledger.size == before + 1
    (preview,) = await daemon.ledger.entries(start=before, kind="route.preview")
    assert (await daemon.ledger.body(preview.body)).value["lane"] == "backend"
    health = await call(client, "health")
    assert health["status"] == "ok"
    assert health["ledger_size"] == daemon.ledger.size
    assert (health["lanes"], health["members"], health["runs_active"]) == (2, 2, 0)


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
    # A lane the roster does not have is not found (its name is valid, so no 422).
    await call(client, "submit", 404, request="x", lane="nope")


async def test_submit_wait_answers_from_the_model(
    client: Client, daemon: Daemon, model: FakeServer
) -> None:
    run = await call(client, "submit", request="fix the api", wait=True, timeout_s=20)
    assert run["state"] == "done", run
    assert run["answer"].startswith("t0 t1 ")  # what the model server generated
    assert run["spent"]["model_calls"] == 1
    assert run["lane"] == "backend"
    assert len(model.requests) == 1
    got = await call(client, "run_get", run_id=run["id"])
    assert got["answer"] == run["answer"]
    assert got["answer_seq"] == run["answer_seq"]
    listed = await call(client, "runs_list", state="done")
    assert [r["id"] for r in listed["runs"]] == [run["id"]]
    assert (await call(client, "runs_list", state="running"))["runs"] == []
    # Cancelling a finished run changes nothing.
    assert (await call(client, "run_cancel", run_id=run["id"]))["state"] == "done"
    await call(client, "run_get", 404, run_id="missing")
    # Idempotency: the same key returns the same run.
    a = await call(client, "submit", request="docs please", idempotency_key="k1")
    b = await call(client, "submit", request="docs please", idempotency_key="k1")
    assert a["id"] == b["id"]
    # ... and so does the same key as an HTTP header
    headers = {"Idempotency-Key": "k1"}
    resp = await client.post("/v1/tools/submit", json={"request": "docs please"}, headers=headers)
    assert (resp.status, (await resp.json())["id"]) == (200, a["id"])
    resp = await client.post(
        "/v1/tools/submit", json={"request": "docs", "idempotency_key": "k2"}, headers=headers
    )
    assert resp.status == 422


async def test_run_cancel_reaches_a_running_run(
    client: Client, daemon: Daemon, model: FakeServer
) -> None:
    model.token_delay_s = 0.05  # 512 tokens: the run would take ~half a minute
    run = await call(client, "submit", request="slow api work")
    for _ in range(200):
        if model.processing:
            break
        await asyncio.sleep(0.01)
    cancelled = await call(client, "run_cancel", run_id=run["id"])
    assert cancelled["state"] == "cancelled"
    kinds = [e.kind for e in await daemon.ledger.entries(run=run["id"], limit=1000)]
    assert k.CANCEL in kinds
    assert kinds[-1] == k.STATE


async def test_run_resume_after_a_restart(tmp_path: Path, model: FakeServer) -> None:
    settings = daemon_settings(tmp_path, model.url)
    first = Daemon(settings)
    await first.start()
    model.token_delay_s = 0.05
    view = await first.engine.submit("the api, slowly")
    while not model.processing:
        await asyncio.sleep(0.01)
    await first.stop()  # drain 0.2 s, then the run is interrupted (witnessed, resumable)
    model.token_delay_s = 0
    second = Daemon(settings)
    await second.start()
    try:
        app = create_app(second, HttpOptions(token=TOKEN))
        async with TestClient(TestServer(app), headers={"Authorization": f"Bearer {TOKEN}"}) as c:
            listed = await call(c, "runs_list", state="interrupted")
            assert [r["id"] for r in listed["runs"]] == [view.id]
            resumed = await call(c, "run_resume", run_id=view.id)
            assert resumed["state"] not in ("interrupted", "failed")
            await call(c, "run_resume", 409, run_id=view.id)
            done = await second.engine.wait(view.id, timeout=20)
            assert done.state == "done"
            got = await call(c, "run_get", run_id=view.id)
            assert got["answer"].startswith("t0 ")
            assert (await call(c, "ledger_verify", deep=True))["ok"]
    finally:
        await second.stop()


async def test_ledger_tools_on_a_real_run(client: Client, daemon: Daemon) -> None:
    run = await call(client, "submit", request="write the api", wait=True, timeout_s=20)
    assert run["state"] == "done"
    entries = await call(client, "ledger_entries", run=run["id"], bodies=True, limit=1000)
    assert entries["size"] == daemon.ledger.size
    first = entries["entries"][0]
    assert first["kind"] == k.REQUEST
    assert first["content"]["request"] == "write the api"
    kinds = [e["kind"] for e in entries["entries"]]
    assert kinds.count(k.MODEL_CALL) == kinds.count(k.MODEL_REPLY) == 1
    reply = next(e for e in entries["entries"] if e["kind"] == k.MODEL_REPLY)
    assert reply["content"]["member"] == "tiny"

    one = await call(client, "ledger_get", seq=run["answer_seq"])
    assert one["kind"] == k.ANSWER
    assert one["content"]["answer"] == run["answer"]
    chain = await call(client, "causal_chain", seq=run["answer_seq"])
    chain_kinds = [e["kind"] for e in chain["entries"]]
    assert chain_kinds[:3] == [k.REQUEST, k.ROUTE, k.PLAN]
    assert chain_kinds[-1] == k.ANSWER
    assert k.MODEL_REPLY in chain_kinds

    verified = await call(client, "ledger_verify", deep=True)
    assert verified["ok"]
    assert verified["size"] == daemon.ledger.size
    proof = await call(client, "ledger_proof", kind="inclusion", seq=run["answer_seq"])
    assert proof["leaf_index"] == run["answer_seq"]
    assert proof["tree_size"] == daemon.ledger.size
    leaf = bytes.fromhex(one["hash"])
    path = [bytes.fromhex(p) for p in proof["path"]]
    root = bytes.fromhex(proof["root"])
    assert verify_inclusion(proof["leaf_index"], proof["tree_size"], leaf, path, root)
    assert proof["root"] == (await call(client, "ledger_verify"))["root"]
    cons = await call(client, "ledger_proof", kind="consistency", old=1)
    assert (cons["old_size"], cons["new_size"]) == (1, daemon.ledger.size)
    await call(client, "ledger_proof", 422, kind="consistency")
    await call(client, "ledger_proof", 404, kind="inclusion", seq=10**9)  # no such leaf yet

    signed = await call(client, "ledger_checkpoint", create=True)
    assert signed["checkpoint"]["size"] == daemon.ledger.size
    latest = await call(client, "ledger_checkpoint")
    assert latest["checkpoint"] == signed["checkpoint"]

    red = await call(client, "ledger_redact", body_hash=first["body"], reason="secret")
    assert red["kind"] == "redaction"
    got = await call(client, "ledger_get", seq=first["seq"])
    assert got["redacted"]
    assert got["content"] is None
    after = await call(client, "ledger_verify", deep=True)
    assert after["ok"]
    assert first["body"] in json.dumps(after["redacted"])
    await call(client, "ledger_redact", 404, body_hash="ab" * 32, reason="nothing there")


async def test_ledger_summary_reads_the_record(client: Client, daemon: Daemon) -> None:
    ok = await call(client, "submit", request="the api", wait=True, timeout_s=20)
    # An assertion the model cannot meet: the task is retried, then escalates from cheap (tiny)
    # to capable (big).
    plan = {
        "tasks": [
            {
                "id": "T1",
                "lane": "backend",
                "instruction": "say the secret word",
                "assertions": [{"type": "contains", "text": "never-said"}],
            }
        ]
    }
    bad = await call(client, "submit", request="escalate me", plan=plan, wait=True, timeout_s=20)
    assert bad["state"] == "failed", bad

    whole = await call(client, "ledger_summary")
    assert whole["run"] is None
    assert whole["entries"] == daemon.ledger.size
    assert whole["by_kind"][k.REQUEST] == 2
    assert whole["escalations"] == 1
    assert set(whole["per_member"]) == {"tiny", "big"}
    # ok: one call; bad: two attempts (`attempts_per_rung`) on each of the two rungs
    assert whole["model_calls"] == whole["by_kind"][k.MODEL_CALL] == 5
    assert whole["by_purpose"] == {"task": 5}
    assert whole["runs_by_state"] == {"done": 1, "failed": 1}
    spent = (
        ok["spent"]["tokens"] + (await call(client, "run_get", run_id=bad["id"]))["spent"]["tokens"]
    )
    assert whole["tokens"] == spent > 0
    assert whole["verify"]["ok"]

    one = await call(client, "ledger_summary", run=ok["id"], verify=False)
    assert one["model_calls"] == 1
    assert one["per_member"]["tiny"]["calls"] == 1
    assert one["per_member"]["tiny"]["completion_tokens"] == 512
    assert one["tokens"] == ok["spent"]["tokens"]
    assert one["escalations"] == 0
    assert one["verify"] is None


async def test_roster_and_slots_tools(client: Client, daemon: Daemon, tmp_path: Path) -> None:
    roster = await call(client, "roster_get")
    assert [lane["name"] for lane in roster["roster"]["lanes"]] == ["backend", "docs"]
    assert await call(client, "roster_reload") == {"lanes": 2, "members": 2}
    broken = tmp_path / "broken.toml"
    broken.write_text("version = 1\n[[lanes]]\nname = 3\n")
    err = await call(client, "roster_reload", 422, path=str(broken))
    assert "broken.toml" in json.dumps(err)
    await call(client, "roster_reload", 404, path=str(tmp_path / "missing.toml"))
    assert (await call(client, "roster_get"))["roster"] == roster["roster"]  # last good kept
    reloads = await daemon.ledger.entries(kind="roster.reload")
    assert len(reloads) == 1

    idle = await call(client, "slots_status")
    assert [m["name"] for m in idle["members"]] == ["tiny", "big"]
    await call(client, "submit", request="the api", wait=True, timeout_s=20)
    status = await call(client, "slots_status")
    tiny = status["members"][0]
    assert tiny["external"]
    assert tiny["state"] == "ready"
    assert tiny["instances"][0]["slots_total"] == 4
    assert (status["busy"], status["idle"], status["queue"]) == (0, 4, 0)


async def test_tally_errors_map_by_status(
    client: Client,
    daemon: Daemon,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    def busy(text: str) -> None:
        raise Busy("queue full", retry_after=2.5)

    monkeypatch.setattr(daemon.router, "route", busy)
    resp = await client.post("/v1/tools/route", json={"text": "x"})
    assert resp.status == 503
    assert resp.headers["Retry-After"] == "3"
    assert (await resp.json())["error"] == {"code": "busy", "message": "queue full", "details": {}}

    # the slot pool's own errors, as a tool that leases directly would see them
    for error, status, code in (
        (PoolBusy("tier cheap: 8 waiting", retry_after=1.0), 503, "pool_busy"),
        (PoolTimeout("no slot within 2 s"), 504, "pool_timeout"),
        (DeadlineExceeded("too slow"), 504, "deadline_exceeded"),
    ):

        def fail(text: str, error: Exception = error) -> None:
            raise error

        monkeypatch.setattr(daemon.router, "route", fail)
        resp = await client.post("/v1/tools/route", json={"text": "x"})
        assert (resp.status, (await resp.json())["error"]["code"]) == (status, code)

    def reset(text: str) -> None:  # an upstream's reset, the client still there: ours
        raise ConnectionResetError("upstream reset")

    monkeypatch.setattr(daemon.router, "route", reset)
    with caplog.at_level(logging.ERROR):
        resp = await client.post("/v1/tools/route", json={"text": "x"})
    assert resp.status == 500
    assert "internal error" in caplog.text
    caplog.clear()

    def gone(text: str) -> None:  # the client disconnected: aiohttp's writer raises this
        runner = client.server.runner
        assert runner is not None
        assert runner.server is not None
        for connection in runner.server.connections:
            assert connection.transport is not None
            connection.transport.close()
        raise ConnectionResetError("Cannot write to closing transport")

    monkeypatch.setattr(daemon.router, "route", gone)
    with caplog.at_level(logging.ERROR), pytest.raises(aiohttp.ServerDisconnectedError):
        await client.post("/v1/tools/route", json={"text": "x"})
    assert "internal error" not in caplog.text  # a disconnect is not logged as our error

    def boom(text: str) -> None:
        raise RuntimeError("secret internals")

    monkeypatch.setattr(daemon.router, "route", boom)
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
    unix_session: aiohttp.ClientSession, unix_server: Path
) -> None:
    assert os.stat(unix_server).st_mode & 0o777 == 0o600
    async with unix_session.post("http://tally/v1/tools/health", json={}) as resp:
        assert resp.status == 200
    async with unix_session.get("http://evil.example/healthz") as resp:
        assert resp.status == 421


async def read_sse(resp: aiohttp.ClientResponse, limit: int | None = None) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = []
    current: dict[str, Any] = {}
    async for raw in resp.content:
        line = raw.decode().rstrip("\n")
        if not line:
            if current:
                events.append(current)
                if limit is not None and len(events) >= limit:
                    break
            current = {}
            continue
        if line.startswith((":", "retry:")):
            continue
        key, _, value = line.partition(": ")
        current[key] = json.loads(value) if key == "data" else value
    return events


async def test_sse_streams_a_real_run_with_deltas(client: Client, model: FakeServer) -> None:
    model.token_delay_s = 0.005  # slow until the stream is open, so no delta can be missed
    run = await call(client, "submit", request="the api", plan=two_tasks())
    resp = await client.get(f"/v1/runs/{run['id']}/events")
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    head = await read_sse(resp, limit=1)
    model.token_delay_s = 0
    events = head + await read_sse(resp)
    kinds = [e.get("event") for e in events]
    assert kinds[0] == k.REQUEST
    assert kinds[-1] == "end"
    assert kinds[-2] == k.STATE
    assert events[-2]["data"]["state"] == "done"
    deltas = [e["data"] for e in events if e.get("event") == "delta"]
    answer = next(e for e in events if e.get("event") == k.ANSWER)["data"]
    assert answer["source"] == "synthesis"
    synthesis = "".join(d["text"] for d in deltas if d["task"] is None)
    # the witnessed answer: the streamed summary, then each task's result verbatim
    assert answer["answer"].startswith(synthesis.strip() + "\n\n## T1 (backend)\n\n")
    assert answer["looped"] is False
    # every chat task streams too, its deltas naming it, each task's text its witnessed result
    results = {
        e["data"]["task"]: e["data"]["output"] for e in events if e.get("event") == k.TASK_RESULT
    }
    for task in ("T1", "T2"):
        assert "".join(d["text"] for d in deltas if d["task"] == task) == results[task]
        assert results[task].strip() in answer["answer"]
    first_synthesis = next(
        i for i, e in enumerate(events) if e.get("event") == "delta" and e["data"]["task"] is None
    )
    assert first_synthesis > max(
        i for i, e in enumerate(events) if e.get("event") == k.TASK_VERDICT
    )
    seqs = [int(e["id"]) for e in events if "id" in e]
    assert seqs == sorted(seqs)
    assert all("id" not in e for e in events if e.get("event") == "delta")


async def test_sse_resume_with_last_event_id_loses_nothing(client: Client, daemon: Daemon) -> None:
    run = await call(client, "submit", request="the api", plan=two_tasks(), wait=True)
    full = [
        e for e in await read_sse(await client.get(f"/v1/runs/{run['id']}/events")) if "id" in e
    ]
    on_record = [e.seq for e in await daemon.ledger.entries(run=run["id"], limit=1000)]
    assert [int(e["id"]) for e in full] == on_record
    # A client that saw the first three events and reconnects gets exactly the rest.
    first = full[:3]
    resp = await client.get(
        f"/v1/runs/{run['id']}/events", headers={"Last-Event-ID": first[-1]["id"]}
    )
    rest = [e for e in await read_sse(resp) if "id" in e]
    assert [e["id"] for e in first + rest] == [e["id"] for e in full]
    assert (await client.get("/v1/runs/nope/events")).status == 404
    bad = await client.get(f"/v1/runs/{run['id']}/events", headers={"Last-Event-ID": "x"})
    assert bad.status == 400


async def test_sse_keepalive_and_shutdown_ends_stream(daemon: Daemon, model: FakeServer) -> None:
    model.token_delay_s = 30  # the run will not move during the test
    app = create_app(daemon, HttpOptions(token=TOKEN, keepalive_s=0.05))
    runner = web.AppRunner(app, shutdown_timeout=30)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    run = await daemon.engine.submit("the api")
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {TOKEN}"}) as s:
        resp = await s.get(f"http://127.0.0.1:{port}/v1/runs/{run.id}/events")
        seen = b""
        while b": keep-alive" not in seen:
            seen += await asyncio.wait_for(resp.content.readany(), 2)
        t0 = asyncio.get_running_loop().time()
        await runner.cleanup()
        # not held for the 30 s shutdown timeout by the open stream (15: a loaded machine)
        assert asyncio.get_running_loop().time() - t0 < 15
        resp.close()
    await daemon.engine.cancel(run.id)


async def test_metrics_text(client: Client, daemon: Daemon) -> None:
    await call(client, "submit", request="the api", plan=two_tasks(), wait=True)
    response = await client.get("/metrics")
    assert response.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    text = await response.text()
    assert 'tally_runs{state="done"} 1' in text
    assert 'tally_tasks{state="done"} 2' in text
    assert "tally_model_calls_total 3" in text  # two tasks + the synthesis
    assert 'tally_slots{member="tiny",state="idle"} 4' in text
    assert 'tally_slots{member="big",state="idle"} 0' in text
    assert 'tally_instances{member="tiny",state="ready"} 1' in text
    assert 'tally_queue_depth{member="tiny"} 0' in text
    assert f"tally_ledger_entries {daemon.ledger.size}" in text
    stats = daemon.ledger.stats
    assert f'tally_ledger_fsync_seconds_bucket{{le="+Inf"}} {stats.fsync_count}' in text
    assert f"tally_ledger_fsync_seconds_count {stats.fsync_count}" in text
    assert stats.appends > 0
    for line in text.splitlines():
        if line and not line.startswith("#"):
            float(line.rsplit(" ", 1)[1])  # every sample value parses


async def test_openapi_document_validates(client: Client) -> None:
    doc = await (await client.get("/openapi.json")).json()
    assert doc["openapi"] == "3.1.0"
    validate(doc)
    assert set(TOOLS) <= {p.rsplit("/", 1)[-1] for p in doc["paths"]}
    assert openapi_document() == doc


async def test_healthz(client: Client, daemon: Daemon) -> None:
    body = await (await client.get("/healthz")).json()
    assert body == {"status": "ok", "ledger_size": daemon.ledger.size}


async def test_plan_tool_waves_and_problems(client: Client) -> None:
    def task(i: str, needs: list[str]) -> dict[str, Any]:
        return {"id": i, "lane": "backend", "instruction": "x", "needs": needs}

    ok = {"tasks": [task("A", []), task("B", ["A"]), task("C", ["A"])]}
    body = await call(client, "plan", plan=ok)
    assert body["ok"]
    assert body["waves"] == [["A"], ["B", "C"]]
    assert (body["critical_path"], body["total_tasks"]) == (2, 3)
    cyc = {"tasks": [task("A", ["B"]), task("B", ["A"])]}
    body = await call(client, "plan", plan=cyc)
    assert not body["ok"]
    assert "cycle" in {p["code"] for p in body["problems"]}
    unknown = {"tasks": [{"id": "A", "lane": "nope", "instruction": "x"}]}
    assert not (await call(client, "plan", plan=unknown))["ok"]


@pytest.mark.parametrize("deep", [False, True])
async def test_ledger_verify_on_a_fresh_daemon(client: Client, deep: bool) -> None:
    assert (await call(client, "ledger_verify", deep=deep))["ok"]


async def test_second_daemon_on_a_live_socket_leaves_it_alone(
    unix_server: Path, tmp_path: Path, model: FakeServer
) -> None:
    """A second `tally serve` on a socket in use refuses, and the first keeps serving."""
    (tmp_path / "second").mkdir()
    second = Daemon(daemon_settings(tmp_path / "second", model.url))
    with pytest.raises(TallyError, match="another daemon is listening"):
        await serve(second, Listen(socket_path=unix_server), HttpOptions())
    assert os.path.exists(unix_server)  # noqa: ASYNC240 - a stat, not I/O worth a thread
    connector = aiohttp.UnixConnector(path=str(unix_server))
    async with (
        aiohttp.ClientSession(connector=connector) as session,
        session.get("http://tally/healthz") as response,
    ):
        assert response.status == 200


async def test_a_caller_waiting_on_a_tier_shows_in_status_and_metrics(
    client: Client, daemon: Daemon
) -> None:
    """Runs lease by tier; a full tier's waiters must not read as an empty queue."""
    held = [await daemon.pool.acquire("cheap") for _ in range(4)]
    waiter = asyncio.create_task(daemon.pool.acquire("cheap"))
    try:
        for _ in range(100):
            if daemon.pool.status().queued:
                break
            await asyncio.sleep(0.01)
        status = await call(client, "slots_status")
        assert status["queue"] == 1
        assert [(t["name"], t["queue"]) for t in status["tiers"]] == [("cheap", 1), ("capable", 0)]
        response = await client.get("/metrics")
        assert 'tally_tier_queue_depth{tier="cheap"} 1' in await response.text()
    finally:
        for lease in held:
            lease.release()
        (await waiter).release()


async def test_submit_can_ask_for_barrier_dispatch(client: Client, daemon: Daemon) -> None:
    run = await call(client, "submit", request="the api", plan=two_tasks(), barrier=True, wait=True)
    assert run["state"] == "done"
    assert daemon.engine.get(run["id"]).barrier is True


async def test_run_get_reads_an_old_finished_run_back_from_the_ledger(
    client: Client, daemon: Daemon
) -> None:
    policy = daemon.engine.roster.policy.model_copy(update={"keep_runs": 1})
    daemon.engine.roster = daemon.engine.roster.model_copy(update={"policy": policy})
    first = await call(client, "submit", request="the api", plan=two_tasks(), wait=True)
    await call(client, "submit", request="more api", plan=two_tasks("more"), wait=True)
    assert daemon.engine.get(first["id"]).tasks[0].result is None  # compacted in memory
    again = await call(client, "run_get", run_id=first["id"])
    assert again["tasks"] == first["tasks"]
    assert again["answer"] == first["answer"]


async def test_serve_warms_the_first_calls_needs_after_it_listens(
    tmp_path: Path, model: FakeServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon listens first; WARM_AFTER_S later the router's index exists without a route,
    and the checkpoint key has been loaded (it writes `checkpoint.vkey` then)."""
    from surfaces import http

    monkeypatch.setattr(http, "WARM_AFTER_S", 0.05)
    daemon = Daemon(daemon_settings(tmp_path, model.url))
    stop = asyncio.Event()
    listening: list[list[str]] = []
    serving = asyncio.create_task(
        serve(
            daemon,
            Listen(socket_path=tmp_path / "t.sock"),
            HttpOptions(),
            announce=listening.append,
            stop=stop,
        )
    )
    try:
        async with asyncio.timeout(10):
            while not listening:
                await asyncio.sleep(0.01)
            assert "_index" not in vars(daemon.router)  # not built before the daemon listened
            vkey = daemon.settings.state_dir / "ledger" / "checkpoint.vkey"
            assert not vkey.exists()
            while "_index" not in vars(daemon.router) or not vkey.exists():
                await asyncio.sleep(0.01)
            assert vkey.read_text().strip() == daemon.ledger.vkey
    finally:
        stop.set()
        await serving


async def test_a_stop_before_the_warm_up_cancels_it(
    tmp_path: Path, model: FakeServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stopped within WARM_AFTER_S, the daemon loads nothing more into itself while it closes
    (the warm-up would otherwise run mid-stop, or find the ledger gone)."""
    from surfaces import http

    warmed: list[object] = []
    monkeypatch.setattr(http, "WARM_AFTER_S", 0.2)
    monkeypatch.setattr(http, "warm", warmed.append)
    daemon = Daemon(daemon_settings(tmp_path, model.url))
    stop = asyncio.Event()
    listening: list[list[str]] = []

    def stop_at_once(where: list[str]) -> None:
        listening.append(where)
        stop.set()

    await serve(
        daemon,
        Listen(socket_path=tmp_path / "t.sock"),
        HttpOptions(),
        announce=stop_at_once,
        stop=stop,
    )
    await asyncio.sleep(0.4)
    assert listening
    assert warmed == []
