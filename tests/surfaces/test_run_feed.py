"""The run feed as a tool (`run_feed`): typed, in OpenAPI and MCP, and what `GET /v1/events`
pushes. Over the real HTTP app on a unix socket, the official MCP SDK client over stdio, and the
real engine with the fake model server."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp

from daemon.service import Daemon
from daemon.tools import TOOLS
from daemon.tools.console import RunFeedOut, RunSummaryOut
from tests.polling import until
from tests.surfaces.conftest import two_tasks
from tests.surfaces.mcp_client import session_for


async def _feed(http: aiohttp.ClientSession, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with http.post("http://tally/v1/tools/run_feed", json=body) as resp:
        return resp.status, await resp.json()


async def test_a_cursor_gives_each_changed_run_once_as_it_stands(
    daemon: Daemon, unix_session: aiohttp.ClientSession
) -> None:
    status, first = await _feed(unix_session, {})
    assert status == 200
    assert first["reset"] is True
    assert first["runs"] == []
    assert first["more"] is False
    cursor = first["cursor"]
    status, same = await _feed(unix_session, {"after": cursor})
    assert (status, same["reset"], same["runs"]) == (200, False, [])  # nothing changed since

    a = await daemon.engine.submit("the api", plan=two_tasks())
    b = await daemon.engine.submit("the docs", plan=two_tasks("docs"))
    await daemon.engine.wait(a.id, 60)
    await daemon.engine.wait(b.id, 60)
    status, got = await _feed(unix_session, {"after": cursor})
    assert status == 200
    assert got["reset"] is False
    assert got["more"] is False
    RunFeedOut.model_validate(got)
    order = [r["id"] for r in got["runs"]]
    assert sorted(order) == sorted([a.id, b.id])  # each once, in the order of its latest change
    done = next(r for r in got["runs"] if r["id"] == a.id)
    assert done["state"] == "done"
    assert done["lanes"] == ["backend"]
    assert done["tasks_total"] == done["tasks_done"] == 2
    assert done["request"] == "the api"
    assert done["spent"]["model_calls"] == daemon.engine.get(a.id).spent.model_calls
    assert set(done) == set(RunSummaryOut.model_fields)

    # `limit` pages through, `more` says there is the rest, the cursor resumes after each
    status, page = await _feed(unix_session, {"after": cursor, "limit": 1})
    assert [r["id"] for r in page["runs"]] == order[:1]
    assert page["more"] is True
    status, rest = await _feed(unix_session, {"after": page["cursor"], "limit": 1})
    assert [r["id"] for r in rest["runs"]] == order[1:]
    assert rest["more"] is False
    assert rest["cursor"] == got["cursor"]
    status, after = await _feed(unix_session, {"after": got["cursor"]})
    assert after["runs"] == []
    assert after["reset"] is False


async def test_a_cursor_it_cannot_answer_from_resets_and_a_malformed_one_is_refused(
    daemon: Daemon, unix_session: aiohttp.ClientSession
) -> None:
    _, first = await _feed(unix_session, {})
    epoch, _, tick = first["cursor"].partition(".")
    other = "0" * 8 if epoch != "0" * 8 else "1" * 8
    for cursor in (f"{other}.{tick}", f"{epoch}.{int(tick) + 5}"):  # another daemon's, future
        status, got = await _feed(unix_session, {"after": cursor})
        assert (status, got["reset"], got["runs"]) == (200, True, []), cursor
        assert got["cursor"] == first["cursor"]
    for bad in ("", "x", f"{epoch}.-1", f"{epoch}.1\n", f"{epoch}.{'9' * 16}", 5):
        status, got = await _feed(unix_session, {"after": bad})
        assert status == 422, bad
    status, _ = await _feed(unix_session, {"limit": 0})
    assert status == 422


async def test_the_log_forgets_its_oldest_runs_and_resets_a_cursor_from_before(
    daemon: Daemon, unix_session: aiohttp.ClientSession
) -> None:
    changes = daemon.engine.changes
    changes.keep = 2
    _, first = await _feed(unix_session, {})
    for run in ("r1", "r2", "r3"):
        changes.change(run)
    status, got = await _feed(unix_session, {"after": first["cursor"]})
    assert (status, got["reset"]) == (200, True)  # r1's change is forgotten: cannot answer
    _, tick = first["cursor"].split(".")
    status, got = await _feed(unix_session, {"after": f"{changes.epoch}.{int(tick) + 1}"})
    assert got["reset"] is False  # from r1's tick on: r2 and r3 are held (not in the table)
    assert got["runs"] == []


async def test_the_console_stream_pushes_the_tools_answers(
    daemon: Daemon, unix_session: aiohttp.ClientSession
) -> None:
    seen: list[dict[str, Any]] = []
    async with unix_session.get("http://tally/v1/events") as resp:
        assert resp.status == 200
        event = ""
        view = None
        async for raw in resp.content:
            line = raw.decode().rstrip("\n")
            if line.startswith("event: "):
                event = line[7:]
                if event == "ready" and view is None:
                    view = await daemon.engine.submit("the api", plan=two_tasks())
            elif line.startswith("data: ") and event == "run":
                seen.append(json.loads(line[6:]))
                if seen[-1]["state"] == "done":
                    break
    assert view is not None
    for summary in seen:
        assert RunSummaryOut.model_validate(summary).model_dump(mode="json") == summary
    assert {s["id"] for s in seen} == {view.id}
    assert seen[-1]["tasks_done"] == 2


async def test_published_in_openapi_and_listed_and_called_over_mcp(
    daemon: Daemon, unix_server: Path, unix_session: aiohttp.ClientSession
) -> None:
    tool = TOOLS["run_feed"]
    assert tool.scope == "read"
    async with unix_session.get("http://tally/openapi.json") as resp:
        document = await resp.json()
    operation = document["paths"]["/v1/tools/run_feed"]["post"]
    assert operation["operationId"] == "run_feed"
    async with session_for(unix_server) as mcp:
        listed = {t.name: t for t in (await mcp.list_tools()).tools}
        assert "run_feed" in listed
        assert set(listed["run_feed"].input_schema["properties"]) == {"after", "limit"}
        assert listed["run_feed"].output_schema is not None
        first = await mcp.call_tool("run_feed", {})
        assert not first.is_error
        assert first.structured_content is not None
        assert first.structured_content["reset"] is True
        view = await daemon.engine.submit("the api", plan=two_tasks())
        await daemon.engine.wait(view.id, 60)

        async def changed() -> list[Any]:
            got = await mcp.call_tool("run_feed", {"after": first.structured_content["cursor"]})
            assert got.structured_content is not None
            return [r["id"] for r in got.structured_content["runs"]]

        assert await until(changed, what="the run in the feed over MCP") == [view.id]
        refused = await mcp.call_tool("run_feed", {"after": "nope"})
        assert refused.is_error


async def test_the_console_stream_says_ready_again_when_its_cursor_cannot_go_on(
    daemon: Daemon, unix_session: aiohttp.ClientSession
) -> None:
    """As after a restart: the feed cannot answer the stream's cursor, so the stream says
    `ready` again (the page lists the runs afresh) and follows from the new cursor."""
    readies = 0
    seen: list[str] = []
    async with unix_session.get("http://tally/v1/events") as resp:
        event = ""
        async for raw in resp.content:
            line = raw.decode().rstrip("\n")
            if line.startswith("event: "):
                event = line[7:]
                if event == "ready":
                    readies += 1
                    if readies == 1:
                        daemon.engine.changes.epoch = "ffffffff"  # the stream's cursor: gone
                    else:
                        await daemon.engine.submit("the api", plan=two_tasks())
            elif line.startswith("data: ") and event == "run":
                seen.append(json.loads(line[6:])["state"])
                if seen[-1] == "done":
                    break
    assert readies == 2
    assert seen[-1] == "done"
