"""The daemon's HTTP API (aiohttp), generated from `daemon.tools.TOOLS` (loaded at first use).

Routes: GET /v1/tools, POST /v1/tools/{name}, GET /v1/runs/{id}/events (SSE), GET /metrics,
GET /openapi.json, GET /healthz. Default transport is a unix socket (0600, peers trusted);
TCP on loopback is opt-in and needs the bearer token. Host and Origin are checked against DNS
rebinding; every error is `{"error": {"code", "message", "details"}}` without a traceback.

One piece past 500 lines: the guard, the routes, the OpenAPI document that describes exactly
those routes and their statuses, and the server's limits change together. The document is the
part to move into its own module once the surface stops changing under parallel work.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import math
import os
import re
import signal
import socket
import struct
import sys
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from pydantic import BaseModel, ValidationError
from pydantic.json_schema import models_json_schema
from pydantic_core import to_jsonable_python

from daemon.clients import DEFAULT, OWNER, Client, Scope
from daemon.errors import Busy, TallyError
from daemon.runs.feed import OVERRUN
from daemon.tls import Listener, bind_refusal, fingerprint, is_loopback, server_context
from surfaces import console, metrics
from surfaces.auth import bearer_ok
from surfaces.connections import (
    GATE,
    STREAM_KEY,
    ConnectionLimits,
    Gate,
    GatedTCPSite,
    counted_stream,
    raise_nofile,
)
from surfaces.gateway import PATHS as GATEWAY_PATHS
from surfaces.gateway import add_routes as gateway_routes
from surfaces.gateway import openapi_paths as gateway_openapi
from surfaces.gateway import reshaped as gateway_shaped
from surfaces.notify import sd_notify, watchdog_task

if TYPE_CHECKING:
    from daemon.service import Daemon
    from daemon.tools import SubmitIn, Tool, ToolContext

log = logging.getLogger("tally.http")

# After this long listening, the daemon loads what a first tool call needs (`warm`): later than
# any readiness probe or spawn-and-call client, sooner than most people's first request.
WARM_AFTER_S = 0.5
SOCKET_HOST = "tally"  # the Host clients send over the unix socket (any value is fine there)
LOOPBACK = ("localhost", "127.0.0.1", "[::1]")
_ORIGIN = re.compile(r"^https?://(localhost|127\.0\.0\.1|\[::1\])(:\d+)?$")


@dataclass(frozen=True)
class HttpOptions:
    token: str | None = None  # required from TCP peers; None = TCP refuses everyone
    body_limit: int = 1024 * 1024
    keepalive_s: float = 15.0  # SSE keep-alive comments
    check_peer_uid: bool = True
    # A connection idle (or still sending its request's headers) this long is closed: it
    # bounds slow-header clients as well as idle keep-alive connections.
    idle_timeout_s: float = 30.0
    body_timeout_s: float = 30.0  # a request body not received in full by then gets a 408
    limits: ConnectionLimits = field(default_factory=ConnectionLimits)  # TCP conns, SSE
    # Names TCP clients reach the daemon by, beside loopback and the bind address (`--host-name`).
    host_names: tuple[str, ...] = ()


DAEMON: web.AppKey[Daemon] = web.AppKey("daemon")
CLIENT = web.RequestKey("client", Client)  # the resolved caller
OPTIONS = web.AppKey("options", HttpOptions)


class Streams:
    """The stop events of open SSE streams (on_shutdown sets them all)."""

    def __init__(self) -> None:
        self.stops: set[asyncio.Event] = set()


STREAMS = web.AppKey("streams", Streams)


# ---------------------------------------------------------------- errors


def error_response(
    status: int, code: str, message: str, details: Any = None, headers: dict[str, str] | None = None
) -> web.Response:
    body = {"error": {"code": code, "message": message, "details": details or {}}}
    return web.json_response(body, status=status, headers=headers)


def _http_code(status: int) -> str:
    return {
        400: "bad_request",
        401: "unauthorized",
        403: "forbidden",
        404: "not_found",
        405: "method_not_allowed",
        408: "request_timeout",
        413: "payload_too_large",
        421: "misdirected_request",
        422: "invalid_input",
    }.get(status, "http_error")


def validation_details(exc: ValidationError) -> dict[str, Any]:
    errors = exc.errors(include_url=False, include_context=False, include_input=False)
    return {"errors": to_jsonable_python(errors)}


@dataclass(frozen=True)
class Peer:
    """What one connection is allowed, computed once per connection (keep-alive reuses it)."""

    unix: bool
    hosts: frozenset[str]  # acceptable Host header values (lowercase)
    foreign_uid: bool
    origins: frozenset[str] = frozenset()  # acceptable Origin hosts beside loopback's
    remote_loopback: bool = True  # the TCP peer's address is on this machine


_PEERS: weakref.WeakKeyDictionary[Any, Peer] = weakref.WeakKeyDictionary()


def _peer(request: web.Request, options: HttpOptions) -> Peer:
    transport = request.transport
    cached = _PEERS.get(transport) if transport is not None else None
    if cached is not None:
        return cached
    sock = transport.get_extra_info("socket") if transport else None
    unix = sock is not None and sock.family == socket.AF_UNIX
    if unix:
        hosts = frozenset((SOCKET_HOST, *LOOPBACK))
        uid = _peer_uid(sock) if options.check_peer_uid and sock is not None else None
        peer = Peer(True, hosts, uid is not None and uid != os.getuid())
    else:
        sockname = transport.get_extra_info("sockname") if transport else None
        port = sockname[1] if isinstance(sockname, tuple) and len(sockname) > 1 else None
        bound = sockname[0] if isinstance(sockname, tuple) and sockname else None
        peername = transport.get_extra_info("peername") if transport else None
        remote = peername[0] if isinstance(peername, tuple) and peername else "?"
        peer = tcp_peer(bound, port, options.host_names, is_loopback(str(remote)))
    if transport is not None:
        _PEERS[transport] = peer
    return peer


def tcp_peer(
    bound: str | None, port: int | None, host_names: tuple[str, ...], remote_loopback: bool
) -> Peer:
    """What a TCP connection accepts as Host: loopback's names, the address the listener is
    bound to and the operator's `--host-name`s, each bare or with the listener's port. Any
    other name (a DNS-rebinding attacker's) is refused. Origins: loopback's on any port (as
    before), the others only on this listener's port."""
    extra = [_host_form(n) for n in (bound, *host_names) if n and not _unspecified(n)]
    names = (*LOOPBACK, *extra)
    hosts = frozenset((*names, *(f"{n}:{port}" for n in names if port is not None)))
    origins = frozenset(f"{n}:{port}" for n in extra if port is not None)
    return Peer(False, hosts, False, origins, remote_loopback)


def _host_form(name: str) -> str:
    """How a Host header writes `name`: an IPv6 address in brackets, lowercase."""
    name = name.strip("[]").lower()
    return f"[{name}]" if ":" in name else name


def _unspecified(name: str) -> bool:
    return name.strip("[]") in ("0.0.0.0", "::")


def origin_ok(origin: str, peer: Peer) -> bool:
    """A browser's Origin is this daemon's: a loopback name (any port), or a name the listener
    answers to on its own port, over http or https."""
    if _ORIGIN.match(origin):
        return True
    scheme, sep, rest = origin.lower().partition("://")
    return bool(sep) and scheme in ("http", "https") and rest in peer.origins


def _peer_uid(sock: socket.socket) -> int | None:
    if not hasattr(socket, "SO_PEERCRED"):
        return None
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return None
    _, uid, _ = struct.unpack("3i", raw)
    return int(uid)


def _refuse(request: web.Request, options: HttpOptions) -> web.Response | None:
    """Host/Origin (DNS rebinding), peer and token checks, body limit: None = let it through."""
    peer = _peer(request, options)
    if request.headers.get("Host", "").lower() not in peer.hosts:
        return error_response(
            421,
            "bad_host",
            "Host header is not this daemon's address (loopback, the bind address, or a "
            "`tally serve --host-name`)",
        )
    origin = request.headers.get("Origin")
    if origin is not None and not origin_ok(origin, peer):
        return error_response(403, "forbidden_origin", "cross-origin requests are not allowed")
    if peer.unix:
        if peer.foreign_uid:
            return error_response(403, "forbidden_peer", "socket peer is another user")
        request[CLIENT] = OWNER
    else:
        client = _bearer_client(request, options)
        if client is DEFAULT and not peer.remote_loopback:
            refused = error_response(
                401,
                "unauthorized",
                "the default token (`tally token`) works only from this machine: give a "
                "client on another machine its own token (`tally client add NAME --scope S`)",
                headers={"WWW-Authenticate": 'Bearer realm="tally"'},
            )
            refused.force_close()
            return refused
        key = f"client:{client.name}" if client is not None else ""
        if client is None and console.HEADER in request.headers:
            known = {r.name for r in request.app[DAEMON].clients.known()}
            found = console.session_client(request, known)
            if found is not None:
                client, key = found
                # Only the console's own script holds the secret; a request that carries it
                # with another Origin is a leak being replayed.
                if origin is not None and not console.same_origin(request):
                    return error_response(
                        403, "forbidden_origin", "a console request needs the console's own Origin"
                    )
        if client is None:
            if request.path == "/healthz" or console.public(request.path):
                return None  # liveness for probes (no details); the console's pages and login
            # The gateway (/v1/chat/completions, /v1/embeddings, /v1/models) needs `submit`.
            scope = (
                "submit"
                if request.path.startswith(("/v1/chat", "/v1/emb", "/v1/models"))
                else "read"
            )
            refused = error_response(
                401,
                "unauthorized",
                "a valid bearer token is required over TCP (`tally client add NAME --scope "
                f"{scope}`, or `tally token` for the default client)",
                headers={"WWW-Authenticate": 'Bearer realm="tally"'},
            )
            refused.force_close()  # nothing more to say to it: its descriptor comes back now
            return refused
        request.app[GATE].authenticated(request.transport)
        request[STREAM_KEY] = key
        request[CLIENT] = client
    length = request.content_length
    if length is not None and length > options.body_limit:
        return error_response(413, "payload_too_large", f"body over {options.body_limit} bytes")
    return None


def _bearer_client(request: web.Request, options: HttpOptions) -> Client | None:
    header = request.headers.get("Authorization")
    if not header or not header.startswith("Bearer "):
        return None
    if options.token and bearer_ok(header, options.token):
        return DEFAULT
    return request.app[DAEMON].clients.lookup(header[len("Bearer ") :].strip())


def client_of(request: web.Request) -> Client | None:
    """The client the guard resolved (None: an unauthenticated /healthz over TCP)."""
    return request.get(CLIENT)


def _forbidden(client: Client, needed: Scope, what: str) -> web.Response:
    return error_response(
        403,
        "forbidden",
        f"client {client.name!r} has scope {client.scope!r}; {what} needs {needed!r}",
        {"needed": needed, "client": client.name},
    )


@web.middleware
async def surface_mw(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """One middleware (each layer costs per request): guard first, then map errors to JSON.
    On the gateway's paths every error is in OpenAI's shape: its handlers answer so
    themselves, and what the guard refuses or escapes them (a 401, a 405) is reshaped here."""
    gateway = request.path in GATEWAY_PATHS
    refused = _refuse(request, request.app[OPTIONS])
    if refused is None:
        try:
            return await handler(request)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            refused = _error(request, exc)
    return gateway_shaped(refused) if gateway and refused.status != 499 else refused


def _error(request: web.Request, exc: Exception) -> web.Response:
    """What a handler's exception answers (an HTTPException below 400 goes on up)."""
    if isinstance(exc, web.HTTPException):
        if exc.status < 400:
            raise exc
        allow = exc.headers.get("Allow")  # a 405 must name the methods that are allowed
        headers = {"Allow": allow} if allow is not None else None
        return error_response(exc.status, _http_code(exc.status), exc.reason, headers=headers)
    if isinstance(exc, TallyError):
        retry = None
        if isinstance(exc, Busy):
            retry = {"Retry-After": str(max(1, math.ceil(exc.retry_after)))}
        return error_response(
            exc.status, exc.code, exc.message, to_jsonable_python(exc.details), retry
        )
    transport = request.transport
    if isinstance(exc, ConnectionResetError) and (transport is None or transport.is_closing()):
        # the client went away mid-answer: no error of ours (an upstream's reset is)
        log.debug("client gone during %s %s", request.method, request.path)
        return web.Response(status=499)  # what the access log shows ("client closed")
    log.exception("internal error on %s %s", request.method, request.path)
    return error_response(500, "internal", "internal error (see the daemon's log)")


# ---------------------------------------------------------------- tools


@functools.cache
def registry() -> dict[str, Tool[Any, Any]]:
    """`daemon.tools.TOOLS`, imported by the first request that needs it: the daemon listens
    without it (collecting its ~50 models' fields is ~15 ms of a start; a first call pays it)."""
    from daemon.tools import TOOLS

    return TOOLS


@functools.cache
def _call_types() -> tuple[type[SubmitIn], type[ToolContext]]:
    """What `call_tool` needs beside the registry, looked up once (an import statement per
    request costs ~0.5 µs on the hot path)."""
    from daemon.tools import SubmitIn, ToolContext

    return SubmitIn, ToolContext


def warm(daemon: Daemon) -> None:
    """Load what the first tool call would otherwise pay for (~30 ms): the registry, the
    router's index and the checkpoint key (`Daemon.warm`). `serve` runs it on the loop once
    the daemon has listened for `WARM_AFTER_S`, so neither readiness nor a quick first call
    waits on the other."""
    registry()
    _call_types()
    daemon.warm()


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


@functools.cache
def _openapi_body() -> bytes:
    return json.dumps(openapi_document(), ensure_ascii=False).encode()


async def list_tools(request: web.Request) -> web.Response:
    return web.Response(body=_listing_body(), content_type="application/json")


async def call_tool(request: web.Request) -> web.Response:
    tool = registry().get(request.match_info["name"])
    if tool is None:
        raise web.HTTPNotFound(reason=f"no tool named {request.match_info['name']!r}")
    submit_in, tool_context = _call_types()
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


# ---------------------------------------------------------------- SSE run events


def sse_frame(kind: str, data: Any, seq: int | None = None) -> bytes:
    head = f"id: {seq}\n" if seq is not None else ""
    payload = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"{head}event: {kind}\ndata: {payload}\n\n".encode()


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


# ---------------------------------------------------------------- metrics, health, openapi


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


# Statuses every tool call can get, whatever the tool (the guard, the body, the arguments).
_TOOL_STATUSES = {
    400: "The body is not valid JSON (RFC 8259: no NaN, no Infinity, no lone surrogates)",
    401: "Missing or wrong bearer token (TCP)",
    403: "The client's scope is too low, the Origin is not allowed, or the unix-socket peer "
    "is another user",
    408: "The request body did not arrive in time",
    413: "Body too large",
    421: "The Host header is not this daemon's address",
    422: "The arguments do not match the input schema (no coercion: `0` is not `false`)",
    500: "Internal error (see the daemon's log)",
}
# Statuses of the GET routes: the guard's, and an internal error.
_GET_STATUSES = {s: _TOOL_STATUSES[s] for s in (401, 403, 413, 421, 500)}
_ERROR_WHY = {
    404: "Not found (a run, an entry, a body, a lane, a tree size the ledger has not reached)",
    409: "Conflict with the current state (e.g. an Idempotency-Key reused, a run not resumable)",
    429: "Over the client's rate limit or token budget (`tally client add --rpm/--tpm/"
    "--tokens-per-day`); see Retry-After",
    503: "Busy or unavailable (e.g. the ledger cannot write); see Retry-After when busy",
}

_ERROR_SCHEMA = {
    "type": "object",
    "required": ["error"],
    "additionalProperties": False,
    "properties": {
        "error": {
            "type": "object",
            "required": ["code", "message", "details"],
            "additionalProperties": False,
            "properties": {
                "code": {"type": "string", "description": "Stable, e.g. invalid_input."},
                "message": {"type": "string"},
                "details": {"type": "object"},
            },
        }
    },
}
_TOOLS_SCHEMA = {
    "type": "object",
    "required": ["tools"],
    "properties": {
        "tools": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name", "description", "input_schema", "output_schema"],
                "properties": {
                    "name": {"type": "string"},
                    "description": {"type": "string"},
                    "input_schema": {"type": "object"},
                    "output_schema": {"type": "object"},
                },
            },
        }
    },
}


_RECORD_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["dialect", "schemas", "kinds"],
    "properties": {
        "dialect": {"type": "string"},
        "schemas": {"type": "object", "additionalProperties": {"type": "object"}},
        "kinds": {
            "type": "object",
            "additionalProperties": {
                "type": "object",
                "required": ["actors", "parents", "optional", "summary"],
                "properties": {
                    "actors": {"type": "array", "items": {"type": "string"}},
                    "parents": {"type": "array", "items": {"type": "string"}},
                    "optional": {"type": "array", "items": {"type": "string"}},
                    "summary": {"type": "string"},
                },
            },
        },
    },
}


def _errors(statuses: dict[int, str]) -> dict[str, Any]:
    err = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    return {
        str(code): {"description": why, "content": err} for code, why in sorted(statuses.items())
    }


def _tool_operation(t: Tool[Any, Any], refs: dict[Any, Any]) -> dict[str, Any]:
    from daemon.tools import ERRORS

    statuses = dict(_TOOL_STATUSES)
    for error in ERRORS.get(t.name, ()):
        statuses[error.status] = _ERROR_WHY[error.status]
    schema = refs[(t.input, "validation")]
    required = bool(t.input.model_json_schema(mode="validation").get("required"))
    body_why = "The tool's arguments." + ("" if required else " An empty body means `{}`.")
    return {
        "operationId": t.name,
        "summary": t.description.split(". ")[0],
        "description": t.description + f" Needs scope `{t.scope}` over TCP.",
        "security": [{"bearer": [t.scope]}],
        "x-tally-scope": t.scope,
        "requestBody": {
            "required": required,
            "description": body_why,
            "content": {"application/json": {"schema": schema}},
        },
        "responses": {
            "200": {
                "description": "OK",
                "content": {"application/json": {"schema": refs[(t.output, "serialization")]}},
            },
            **_errors(statuses),
        },
    }


def openapi_document() -> dict[str, Any]:
    """OpenAPI 3.1 from the registry's models (plain JSON Schema 2020-12 throughout)."""
    tools = registry()
    pairs: list[tuple[type[BaseModel], Any]] = []
    for t in tools.values():
        pairs.append((t.input, "validation"))
        pairs.append((t.output, "serialization"))
    refs, top = models_json_schema(pairs, ref_template="#/components/schemas/{model}")
    schemas: dict[str, Any] = dict(top.get("$defs", {}))
    schemas["Error"] = _ERROR_SCHEMA
    paths: dict[str, Any] = {
        f"/v1/tools/{t.name}": {"post": _tool_operation(t, refs)} for t in tools.values()
    }
    paths["/v1/tools"] = {
        "get": {
            "operationId": "list_tools",
            "summary": "The tool set with input and output JSON schemas",
            "responses": {
                "200": {
                    "description": "OK",
                    "content": {"application/json": {"schema": _TOOLS_SCHEMA}},
                },
                **_errors(_GET_STATUSES),
            },
        }
    }
    paths["/v1/runs/{run_id}/events"] = {
        "get": {
            "operationId": "run_events",
            "summary": "Server-sent events of a run (ledger seq as id; Last-Event-ID resumes)",
            "parameters": [
                {"name": "run_id", "in": "path", "required": True, "schema": {"type": "string"}},
                {
                    "name": "Last-Event-ID",
                    "in": "header",
                    "required": False,
                    "schema": {"type": "string", "pattern": "^[0-9]*$"},
                },
            ],
            "responses": {
                "200": {"description": "event stream", "content": {"text/event-stream": {}}},
                **_errors(
                    {
                        **_GET_STATUSES,
                        400: "Last-Event-ID is not a ledger seq",
                        404: "No such run",
                        429: "The client has its limit of event streams open",
                    }
                ),
            },
        }
    }
    paths["/v1/record/schema"] = {
        "get": {
            "operationId": "record_schema",
            "summary": "The JSON Schema (2020-12) of every ledger entry kind, keyed by kind",
            "description": "The record's vocabulary, as `tally ledger schema` prints it: "
            "`schemas` holds each kind's body schema (tolerant of fields a later tally adds), "
            "`kinds` who writes it, the kinds its parent may be, and the fields it writes only "
            "when they hold something. `tally ledger verify --deep` checks bodies against it.",
            "security": [{"bearer": ["read"]}],
            "responses": {
                "200": {
                    "description": "OK",
                    "content": {"application/json": {"schema": _RECORD_SCHEMA}},
                },
                **_errors(_GET_STATUSES),
            },
        }
    }
    gateway_paths, gateway_schemas = gateway_openapi()
    paths.update(gateway_paths)
    schemas.update(gateway_schemas)
    for path, op, summary, ctype in [
        ("/metrics", "metrics", "Prometheus metrics", "text/plain"),
        ("/healthz", "healthz", "Liveness", "application/json"),
        ("/openapi.json", "openapi", "This document", "application/json"),
    ]:
        paths[path] = {
            "get": {
                "operationId": op,
                "summary": summary,
                # /healthz answers without a token (no details); the rest need any client
                "security": [] if op == "healthz" else [{"bearer": ["read"]}],
                "responses": {
                    "200": {"description": "OK", "content": {ctype: {}}},
                    **_errors(
                        {s: why for s, why in _GET_STATUSES.items() if op != "healthz" or s != 401}
                    ),
                },
            }
        }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "tally",
            "version": "1",
            "description": "One tool set, identical over HTTP and MCP. Over TCP every request "
            "but /healthz needs `Authorization: Bearer <token>` of a named client (`tally "
            "client add`) or the default one (`tally token`), whose scope (read < submit < "
            "command < admin) covers the operation's; the unix socket's peer is the owner "
            "(admin). Input is validated exactly as the schemas say, without coercion. "
            'Every error is `{"error": {"code", "message", "details"}}`, except on the '
            "OpenAI-compatible gateway (/v1/models, /v1/chat/completions, /v1/embeddings), "
            'whose errors are OpenAI\'s `{"error": {"message", "type", "param", "code"}}`; a '
            "405 names the allowed methods in `Allow`.",
        },
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": ["read"]}],
    }


async def get_openapi(request: web.Request) -> web.Response:
    return web.Response(body=_openapi_body(), content_type="application/json")


# ---------------------------------------------------------------- app and server


class ServerLog(logging.LoggerAdapter[logging.Logger]):
    """aiohttp's server log. A malformed request (oversized or invalid headers, a bad request
    line) is the client's doing: one WARNING line naming the peer and the reason, not an
    ERROR with a traceback per request. Anything else keeps its traceback."""

    def exception(self, msg: object, *args: object, exc_info: Any = True, **kwargs: Any) -> None:
        exc = exc_info if isinstance(exc_info, BaseException) else sys.exc_info()[1]
        if isinstance(exc, HttpProcessingError):
            where = str(msg) % args if args else str(msg)
            why = " ".join(str(exc.message).split())[:300]  # the peer's bytes, on one line
            self.logger.warning("%s: %s %s", where, exc.code, why)
            return
        super().exception(msg, *args, exc_info=exc_info, **kwargs)


def app_runner(app: web.Application, options: HttpOptions) -> web.AppRunner:
    """The runner with the server's limits: idle and slow-header connections are closed after
    `idle_timeout_s`, bad requests are logged as one line."""
    return web.AppRunner(
        app,
        shutdown_timeout=5.0,
        access_log=None,
        keepalive_timeout=options.idle_timeout_s,
        # After an early answer (413, 408) the unread rest of a body is drained this long at
        # most, so the client can read the answer, then the connection is closed.
        lingering_time=2.0,
        logger=ServerLog(logging.getLogger("aiohttp.server")),
    )


def create_app(daemon: Daemon, options: HttpOptions | None = None) -> web.Application:
    options = options or HttpOptions()
    app = web.Application(middlewares=[surface_mw], client_max_size=options.body_limit)
    app[DAEMON] = daemon
    app[OPTIONS] = options
    app[STREAMS] = Streams()
    app[GATE] = Gate.make(options.limits)
    app.on_shutdown.append(close_streams)
    app.router.add_get("/v1/tools", list_tools)
    app.router.add_post("/v1/tools/{name}", call_tool)
    app.router.add_get("/v1/runs/{run_id}/events", counted_stream(run_events))
    app.router.add_get("/metrics", get_metrics)
    app.router.add_get("/openapi.json", get_openapi)
    app.router.add_get("/v1/record/schema", get_record_schema)
    app.router.add_get("/healthz", healthz)
    gateway_routes(app)
    console.register(app)
    return app


def parse_tcp(value: str, *, tls: bool = False, insecure_http: bool = False) -> tuple[str, int]:
    """`ADDR:PORT` (`[v6]:PORT` for IPv6), refused beyond loopback unless it is served with
    `tls` or `insecure_http` is asked for (`daemon.tls.bind_refusal`): a caller that does not
    say gets loopback only, as before."""
    host, sep, port = value.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"--tcp wants ADDR:PORT (e.g. 127.0.0.1:8765), got {value!r}")
    refusal = bind_refusal(host, tls, insecure_http)
    if refusal is not None:
        raise ValueError(refusal)
    return host, int(port)


@dataclass(frozen=True)
class Listen:
    socket_path: Path | None
    tcp: str | None = None
    # TLS for the TCP listener: (certificate chain, key); None = plain HTTP
    tls: tuple[Path, Path] | None = None
    insecure_http: bool = False  # plain HTTP beyond loopback, asked for (`--insecure-http`)


def _prepare_socket_path(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    if path.exists() or path.is_symlink():
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink()  # stale socket from a crashed daemon
        else:
            raise TallyError(f"another daemon is listening on {path}")
        finally:
            probe.close()


async def serve(
    daemon: Daemon,
    listen: Listen,
    options: HttpOptions,
    *,
    announce: Callable[[list[str]], None] | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Start the daemon, listen, notify READY, run until SIGTERM/SIGINT, stop cleanly.

    READY=1 is sent only after `daemon.start()` (ledger recovered) and every site listens.
    """
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    if listen.socket_path is not None:
        # Refuse before opening the ledger, and never touch a socket another daemon owns.
        _prepare_socket_path(listen.socket_path)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    raise_nofile()  # before anything opens: the TCP gate sizes itself from the limit
    daemon.stop_requested = stop  # `tally stop` (the daemon_stop tool) stops as SIGTERM does
    await daemon.start()
    runner = app_runner(create_app(daemon, options), options)
    where: list[str] = []
    daemon.listeners = where  # for `status`, filled as each site listens
    bound_socket = False
    warming: asyncio.TimerHandle | None = None
    try:
        await runner.setup()
        if listen.socket_path is not None:
            _prepare_socket_path(listen.socket_path)
            old = os.umask(0o177)  # the socket is born 0600: no window where others can connect
            try:
                await web.UnixSite(runner, str(listen.socket_path)).start()
                bound_socket = True
            finally:
                os.umask(old)
            os.chmod(listen.socket_path, 0o600)
            where.append(f"unix:{listen.socket_path}")
        if listen.tcp is not None:
            base = await _start_tcp(runner, daemon, listen, options)
            where.append(base)
            console.set_base(runner.app, base)
        if announce is not None:
            announce(where)
        sd_notify(f"READY=1\nSTATUS=listening on {', '.join(where)}")
        warming = loop.call_later(WARM_AFTER_S, warm, daemon)
        async with watchdog_task():
            await stop.wait()
        sd_notify("STOPPING=1")
        _say_stopping(daemon)
    finally:
        if warming is not None:
            warming.cancel()  # a stop within WARM_AFTER_S: nothing to load into a closing daemon
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await runner.cleanup()
        await daemon.stop()
        if bound_socket and listen.socket_path is not None:
            with contextlib.suppress(FileNotFoundError):
                listen.socket_path.unlink()


async def _start_tcp(
    runner: web.AppRunner, daemon: Daemon, listen: Listen, options: HttpOptions
) -> str:
    """Refuse clear text beyond loopback (unless asked), listen (over TLS when given), and
    tell the daemon what it listens as (`health`; `--insecure-http` witnessed). The URL."""
    assert listen.tcp is not None
    try:
        host, port = parse_tcp(
            listen.tcp, tls=listen.tls is not None, insecure_http=listen.insecure_http
        )
    except ValueError as exc:
        raise TallyError(str(exc)) from None
    context = server_context(*listen.tls) if listen.tls is not None else None
    site = GatedTCPSite(runner, host, port, runner.app[GATE], ssl_context=context)
    await site.start()
    scheme = "https" if context is not None else "http"
    name = options.host_names[0] if options.host_names else host
    base = f"{scheme}://{_host_form(name)}:{site.port}"
    cert = listen.tls[0] if listen.tls is not None else None
    await daemon.witness_listener(
        Listener(
            url=base,
            tls=context is not None,
            tls_fingerprint=fingerprint(cert.read_bytes()) if cert is not None else None,
            cert_path=str(cert) if cert is not None else None,
            insecure_http=context is None and listen.insecure_http,
            host_names=list(options.host_names),
        )
    )
    return base


def _say_stopping(daemon: Daemon) -> None:
    """What a stop (Ctrl-C, SIGTERM) does, said once, before the drain starts."""
    n = daemon.engine.in_flight()
    drain = daemon.settings.drain_s
    if n:
        message = (
            f"stopping: draining {n} run{'s' if n != 1 else ''}… (up to {drain:g} s; what is "
            "still running then is interrupted and `tally resume RUN` continues it)"
        )
    else:
        message = "stopping: no run in flight"
    log.warning(message)  # `tally serve` logs to stderr: this is the line Ctrl-C prints


def log_to_stderr(level: int = logging.INFO) -> None:
    logging.basicConfig(
        stream=sys.stderr, level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
