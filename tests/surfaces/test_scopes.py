"""Named clients and scopes, end to end: a real `tally serve --tcp` process, every tool called
with a token of every scope over HTTP (a real socket) and over MCP (the official SDK client
through the stdio adapter); what is allowed is exactly what the registry declares."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from mcp import ClientSession, StdioServerParameters
from mcp.client.stdio import stdio_client

from daemon import record
from daemon.clients import SCOPES, Client, ClientStore, Scope
from daemon.tools import TOOLS
from tests.slots.fake_server import FakeServer
from tests.surfaces.tcp import ROOT, Tcp

# Arguments every tool accepts and that are harmless however often they are sent: an allowed
# call answers 200, 404 or 409, a refused one 403, before anything is validated or done.
SAMPLES: dict[str, dict[str, Any]] = {
    "health": {},
    "route": {"text": "add tests for the parser"},
    "route_teach": {"lane": "no-such-lane", "text": "x"},
    "route_suggest": {"limit": 1},
    "plan": {"plan": {"tasks": [{"id": "a", "lane": "backend", "instruction": "x"}]}},
    "submit": {"request": "x", "lane": "no-such-lane"},
    "run_get": {"run_id": "nope"},
    "runs_list": {},
    "run_cancel": {"run_id": "nope"},
    "run_resume": {"run_id": "nope"},
    "run_retry": {"run_id": "nope"},
    "run_replay": {"run_id": "nope"},
    "run_patch": {"run_id": "nope"},
    "run_apply": {"run_id": "nope", "check": True},
    "run_compare": {"a": "nope", "b": "nope"},
    "ledger_verify": {},
    "ledger_verify_remote": {"limit": 1},
    "ledger_entries": {"limit": 1},
    "ledger_get": {"seq": 0},
    "ledger_proof": {"kind": "inclusion", "seq": 0},
    "ledger_checkpoint": {},
    "ledger_cosign": {"note": "x\n1\n" + "A" * 43 + "=\n\n— x " + "A" * 92 + "\n"},  # unknown: 404
    "ledger_cosigned": {},
    "ledger_cosign_collect": {},
    "causal_chain": {"seq": 0},
    "ledger_redact": {"body_hash": "0" * 64, "reason": "scope table"},
    "roster_get": {},
    "roster_reload": {},
    "slots_status": {},
    "ledger_summary": {"verify": False},
    "client_add": {"name": "made-by-table", "scope": "read"},
    "client_list": {},
    "client_revoke": {"name": "no-such-client"},
    "status": {},
    "run_feed": {},
    "daemon_stop": {},  # last: the admin client's call stops the daemon (scopes go in order)
}


def test_every_tool_has_a_sample_and_a_scope() -> None:
    assert set(SAMPLES) == set(TOOLS)
    assert {t.scope for t in TOOLS.values()} <= set(SCOPES)
    assert TOOLS["ledger_redact"].scope == TOOLS["roster_reload"].scope == "admin"
    assert TOOLS["client_add"].scope == "admin"
    assert TOOLS["submit"].scope == "submit"
    assert TOOLS["run_apply"].scope == "command"  # it writes the user's files
    assert all(TOOLS[n].scope == "read" for n in ("ledger_entries", "ledger_proof", "route"))


class Scoped(Tcp):
    tokens: dict[Scope, str]


@pytest.fixture
async def tcp(tmp_path: Path, model: FakeServer) -> AsyncIterator[Scoped]:
    daemon = Scoped(tmp_path, model)
    store = ClientStore(daemon.state)  # made before start: the daemon reads the file
    daemon.tokens = {scope: store.add(f"c-{scope}", scope) for scope in SCOPES}
    await daemon.start()
    try:
        yield daemon
    finally:
        await daemon.stop()


def _allowed(status: int, body: dict[str, Any]) -> bool:
    refused = status == 403 and body.get("error", {}).get("code") == "forbidden"
    assert refused or status in (200, 404, 409), (status, body)
    return not refused


async def test_every_tool_times_every_scope_over_http(tcp: Scoped) -> None:
    async with aiohttp.ClientSession() as http:
        for scope, token in tcp.tokens.items():
            client = Client(f"c-{scope}", scope)
            for name, args in SAMPLES.items():
                headers = {"Authorization": f"Bearer {token}"}
                url = f"{tcp.url}/v1/tools/{name}"
                async with http.post(url, json=args, headers=headers) as resp:
                    allowed = _allowed(resp.status, await resp.json())
                assert allowed == client.allows(TOOLS[name].scope), (scope, name)
    await _stopped_cleanly(tcp)


async def _stopped_cleanly(tcp: Scoped) -> None:
    """The admin client's daemon_stop, the table's last call, stopped the daemon cleanly."""
    assert tcp.proc is not None
    assert await asyncio.wait_for(tcp.proc.wait(), 30) == 0


async def test_every_tool_times_every_scope_over_mcp(tcp: Scoped) -> None:
    for scope, token in tcp.tokens.items():
        client = Client(f"c-{scope}", scope)
        params = StdioServerParameters(
            command=sys.executable,
            args=["-m", "surfaces", "mcp"],
            env={"TALLY_URL": tcp.url, "TALLY_TOKEN": token},
            cwd=str(ROOT),
        )
        async with stdio_client(params) as (read, write), ClientSession(read, write) as session:
            await session.initialize()
            listed = {t.name: t for t in (await session.list_tools()).tools}
            for name, args in SAMPLES.items():
                hints = listed[name].annotations
                assert hints is not None
                assert hints.read_only_hint == (TOOLS[name].scope == "read")
                result = await session.call_tool(
                    name, {**args, "name": f"mcp-{scope}"} if name == "client_add" else args
                )
                text = json.dumps([c.model_dump() for c in result.content])
                refused = result.is_error and "forbidden" in text
                assert refused != client.allows(TOOLS[name].scope), (scope, name, text)
    await _stopped_cleanly(tcp)


async def test_tokens_healthz_metrics_and_revocation(tcp: Scoped) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{tcp.url}/healthz") as resp:  # no token: alive, nothing more
            assert resp.status == 200
            assert await resp.json() == {"status": "ok"}
        async with http.get(f"{tcp.url}/metrics") as resp:
            assert resp.status == 401
            assert resp.headers["WWW-Authenticate"].startswith("Bearer")
        read = {"Authorization": f"Bearer {tcp.tokens['read']}"}
        async with http.get(f"{tcp.url}/metrics", headers=read) as resp:
            assert resp.status == 200
        async with http.get(f"{tcp.url}/v1/record/schema") as resp:
            assert resp.status == 401
        async with http.get(f"{tcp.url}/v1/record/schema", headers=read) as resp:
            assert resp.status == 200  # the record's vocabulary: scope read
            assert await resp.json() == json.loads(json.dumps(record.document()))
        async with http.get(f"{tcp.url}/healthz", headers=read) as resp:
            assert "ledger_size" in await resp.json()
        admin = {"Authorization": f"Bearer {tcp.tokens['admin']}"}
        async with http.post(
            f"{tcp.url}/v1/tools/client_revoke", json={"name": "c-read"}, headers=admin
        ) as resp:
            assert resp.status == 200
        async with http.get(f"{tcp.url}/metrics", headers=read) as resp:
            assert resp.status == 401  # at once: no restart, no cache to expire


async def test_command_runs_need_the_command_scope_and_runs_name_their_client(
    tcp: Scoped,
) -> None:
    plan = {
        "tasks": [
            {"id": "c", "lane": "backend", "instruction": "x", "executor": "command"}
            | {"argv": ["true"]}
        ]
    }
    async with aiohttp.ClientSession() as http:

        async def submit(scope: Scope, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
            headers = {"Authorization": f"Bearer {tcp.tokens[scope]}"}
            async with http.post(f"{tcp.url}/v1/tools/submit", json=body, headers=headers) as resp:
                return resp.status, await resp.json()

        status, body = await submit("submit", {"request": "run it", "plan": plan})
        assert status == 403
        assert body["error"]["details"]["needed"] == "command"
        status, body = await submit("command", {"request": "run it", "plan": plan})
        assert status == 200
        run_id = body["id"]
        status, _ = await submit("submit", {"request": "just chat", "lane": "backend"})
        assert status == 200
        admin = {"Authorization": f"Bearer {tcp.tokens['admin']}"}
        async with http.post(
            f"{tcp.url}/v1/tools/ledger_entries",
            json={"run": run_id, "kind": "run.request", "bodies": True},
            headers=admin,
        ) as resp:
            (request,) = (await resp.json())["entries"]
        assert request["content"]["client"] == "c-command"
        async with http.post(
            f"{tcp.url}/v1/tools/ledger_summary",
            json={"client": "c-command", "verify": False},
            headers=admin,
        ) as resp:
            summary = await resp.json()
        assert summary["by_client"]["c-command"]["runs"] == 1
        assert set(summary["by_client"]) == {"c-command"}


async def test_openapi_security_is_what_the_server_enforces(tcp: Scoped) -> None:
    headers = {"Authorization": f"Bearer {tcp.tokens['read']}"}
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"{tcp.url}/openapi.json", headers=headers) as resp,
    ):
        doc = await resp.json()
    assert doc["security"] == [{"bearer": ["read"]}]
    for name, tool in TOOLS.items():
        op = doc["paths"][f"/v1/tools/{name}"]["post"]
        assert op["security"] == [{"bearer": [tool.scope]}], name
        assert "401" in op["responses"]
        assert "403" in op["responses"]
    assert doc["paths"]["/healthz"]["get"]["security"] == []
    assert doc["paths"]["/metrics"]["get"]["security"] == [{"bearer": ["read"]}]


async def test_a_broken_client_file_refuses_tokens_and_is_never_written_over(
    tcp: Scoped,
) -> None:
    """A client file broken by hand (or damage) once made every TCP request a bare 500 with a
    traceback in the log, and the CLI print pydantic's dump. Now: tokens are refused (fail
    closed, a JSON 401), the file is named with what to do, and nothing writes over it."""
    path = tcp.state / "clients.json"
    good = path.read_bytes()
    read = {"Authorization": f"Bearer {tcp.tokens['read']}"}
    admin = {"Authorization": f"Bearer {tcp.tokens['admin']}"}
    broken = good[: len(good) // 2]
    path.write_bytes(broken)
    async with aiohttp.ClientSession() as http:
        for url in ("/metrics", "/v1/tools/status"):
            async with http.post(f"{tcp.url}{url}", json={}, headers=read) as resp:
                assert resp.status in (401, 405), url
                assert "error" in await resp.json()
        async with http.post(f"{tcp.url}/v1/tools/status", json={}, headers=admin) as resp:
            assert resp.status == 401
    owner = ["--socket", str(tcp.socket)]  # the socket owner is no client: it is still served
    code, out, err = await tcp.tally("client", "add", "late", "--scope", "read", *owner)
    assert code == 1, out + err
    assert f"client file {path}" in err, err
    assert "fix it by hand" in err, err
    code, out, err = await tcp.tally("client", "list", *owner)
    assert code == 1, out + err
    assert f"client file {path}" in err, err
    assert path.read_bytes() == broken  # nothing written over it: its clients are not lost
    path.write_bytes(good)
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{tcp.url}/v1/tools/status", json={}, headers=read) as resp,
    ):
        assert resp.status == 200  # fixed: read again at once
    log = (tcp.state / "logs" / "daemon.log").read_text()
    assert "Traceback" not in log
    assert log.count(f"client file {path}") == 1  # told once, not per request
