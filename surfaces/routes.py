"""The HTTP routes of the tools and what sits beside them: GET /v1/tools, POST
/v1/tools/{name}, GET /v1/runs/{id}/events (SSE), GET /metrics, GET /v1/record/schema and GET
/healthz. Each is an adapter: the registry (`daemon.tools.TOOLS`, loaded at first use) holds
what a tool does; a route reads the body, checks the client's scope and writes the answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import re
from typing import TYPE_CHECKING, Any

from aiohttp import web
from pydantic import ValidationError

from daemon.clients import OWNER, Client, Scope
from daemon.runs.feed import OVERRUN
from surfaces import metrics
from surfaces.answers import error_response, sse_frame, validation_details
from surfaces.app import DAEMON, OPTIONS, STREAMS, client_of
from surfaces.connections import GATE

if TYPE_CHECKING:
    from daemon.tools import SubmitIn, Tool, ToolContext


@functools.cache
def registry() -> dict[str, Tool[Any, Any]]:
    """`daemon.tools.TOOLS`, imported by the first request that needs it: the daemon listens
    without it (collecting its ~50 models' fields is ~15 ms of a start; a first call pays it)."""
    from daemon.tools import TOOLS

    return TOOLS


@functools.cache
def call_types() -> tuple[type[SubmitIn], type[ToolContext]]:
    """What `call_tool` needs beside the registry, looked up once (an import statement per
    request costs ~0.5 µs on the hot path)."""
    from daemon.tools import SubmitIn, ToolContext

    return SubmitIn, ToolContext


def tool_listing() -> list[dict[str, Any]]:
    """The tool list as HTTP and MCP publish it (the parity test compares both)."""
    return [
        {
            "name": t.name,
            "description": t.description,
            "scope": t.scope,
            "input_schema": t.input.model_json_schema(mode="validation"),
            "output_schema": t.output.model_json_schema(mode="serialization"),
        }
        for t in registry().values()
    ]


@functools.cache
def _listing_body() -> bytes:
    """Built once: the registry is fixed for the process (a roster reload changes no schema)."""
    return json.dumps({"tools": tool_listing()}, ensure_ascii=False).encode()


async def list_tools(request: web.Request) -> web.Response:
    return web.Response(body=_listing_body(), content_type="application/json")


async def call_tool(request: web.Request) -> web.Response:
    tool = registry().get(request.match_info["name"])
    if tool is None:
        raise web.HTTPNotFound(reason=f"no tool named {request.match_info['name']!r}")
    submit_in, tool_context = call_types()
    client = client_of(request) or OWNER
    if not client.allows(tool.scope):  # before reading the body: a refusal reveals nothing
        return _forbidden(client, tool.scope, tool.name)
    if request.content.is_eof():  # the whole body is in already: reading it cannot wait
        raw = await request.read()
    else:
        try:
            async with asyncio.timeout(request.app[OPTIONS].body_timeout_s):
                raw = await request.read()
        except TimeoutError:
            response = error_response(408, "request_timeout", "the request body did not arrive")
            response.force_close()
            return response
    try:
        # pydantic-core parses and validates in one pass (no json.loads + dict walk).
        # An empty body is `{}`: a tool whose input has required fields still gets a 422.
        data = tool.input.model_validate_json(raw if raw.strip() else b"{}")
    except ValidationError as exc:
        if any(e["type"] == "json_invalid" for e in exc.errors()):
            return error_response(400, "bad_json", "the body is not valid JSON")
        return error_response(422, "invalid_input", "invalid arguments", validation_details(exc))
    key = request.headers.get("Idempotency-Key")
    if key is not None and isinstance(data, submit_in):
        if data.idempotency_key not in (None, key) or not 0 < len(key) <= 200:
            message = "Idempotency-Key must be 1-200 characters and match idempotency_key if both"
            return error_response(422, "invalid_input", message)
        data = data.model_copy(update={"idempotency_key": key})
    out = await tool.handler(request.app[DAEMON], data, tool_context(client=client))
    return web.Response(body=out.model_dump_json().encode(), content_type="application/json")


def _forbidden(client: Client, needed: Scope, what: str) -> web.Response:
    return error_response(
        403,
        "forbidden",
        f"client {client.name!r} has scope {client.scope!r}; {what} needs {needed!r}",
        {"needed": needed, "client": client.name},
    )


async def run_events(request: web.Request) -> web.StreamResponse:
    daemon = request.app[DAEMON]
    run_id = request.match_info["run_id"]
    daemon.engine.get(run_id)  # NotFound -> 404 before the stream starts
    last = request.headers.get("Last-Event-ID") or request.query.get("after")
    if last and not re.fullmatch(r"[0-9]{1,16}", last):
        return error_response(400, "bad_request", "Last-Event-ID must be a ledger seq")
    after = int(last) if last else None
    resp = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
        }
    )
    await resp.prepare(request)
    stop = asyncio.Event()
    request.app[STREAMS].stops.add(stop)
    events = daemon.engine.events(run_id, after=after).__aiter__()
    stopped = asyncio.ensure_future(stop.wait())
    pending: asyncio.Future[Any] | None = None
    try:
        await resp.write(b"retry: 1000\n\n")
        while True:
            if pending is None:
                pending = asyncio.ensure_future(events.__anext__())
            done, _ = await asyncio.wait(
                {pending, stopped},
                timeout=request.app[OPTIONS].keepalive_s,
                return_when=asyncio.FIRST_COMPLETED,
            )
            if stopped in done:
                break
            if pending not in done:
                await resp.write(b": keep-alive\n\n")
                continue
            try:
                event = pending.result()
            except StopAsyncIteration:
                await resp.write(sse_frame("end", {"run_id": run_id}))
                break
            pending = None
            await resp.write(sse_frame(event.kind, event.data, event.seq))
            if event.kind == OVERRUN:
                break  # dropped as too slow: no `end`, so the client resumes (Last-Event-ID)
    except ConnectionResetError:  # the client left; a cancel (shutdown) goes on up
        pass
    finally:
        request.app[STREAMS].stops.discard(stop)
        stopped.cancel()
        if pending is not None:
            pending.cancel()
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(Exception):
                await aclose()
    with contextlib.suppress(ConnectionResetError):
        await resp.write_eof()
    return resp


async def close_streams(app: web.Application) -> None:
    """on_shutdown: end every SSE stream at once, so shutdown does not wait for them."""
    for stop in list(app[STREAMS].stops):
        stop.set()


async def get_metrics(request: web.Request) -> web.Response:
    text = metrics.render(request.app[DAEMON], request.app[GATE])
    # The Prometheus text format names its version in the media type.
    return web.Response(
        body=text.encode(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}
    )


@functools.cache
def _record_schema_body() -> bytes:
    from daemon.record import document

    return json.dumps(document(), ensure_ascii=False).encode()


async def get_record_schema(request: web.Request) -> web.Response:
    """The record's vocabulary: every entry kind's JSON Schema (2020-12), keyed by kind."""
    return web.Response(body=_record_schema_body(), content_type="application/json")


async def healthz(request: web.Request) -> web.Response:
    daemon = request.app[DAEMON]
    health = daemon.ledger.health
    status = "ok" if health.writable else "degraded"
    if client_of(request) is None:  # unauthenticated over TCP: the state, no details
        return web.json_response({"status": status})
    # Still 200 when degraded: the daemon is alive, and a restart would not help.
    body: dict[str, Any] = {"status": status, "ledger_size": daemon.ledger.size}
    if not health.writable:
        body["reason"] = f"the ledger cannot write: {health.detail}"
    return web.json_response(body)
