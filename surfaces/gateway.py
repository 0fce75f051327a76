"""OpenAI-compatible routes on the daemon's own listeners: GET /v1/models,
POST /v1/chat/completions, POST /v1/embeddings.

An adapter like the tool routes: `daemon.gateway` resolves, leases, witnesses and relays; this
module reads the body, checks the scope, writes JSON or SSE, and turns every error into
OpenAI's shape (`{"error": {"message", "type", "param", "code"}}`) so SDKs report it as
theirs. The listeners' guard (Host, Origin, token over TCP, body size) ran before any of it.

A client that goes away cancels its call: a streamed answer notices at its next write, and a
watcher notices a closed connection within `DISCONNECT_POLL_S` while nothing is being written
(a long prompt, a queue wait), so the upstream request is cut and the slot freed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
from typing import TYPE_CHECKING, Any

from aiohttp import web
from pydantic import BaseModel

from daemon.clients import OWNER, Client
from daemon.errors import Busy, DeadlineExceeded, Forbidden, InvalidInput, NotFound, TallyError
from daemon.quotas import RateLimited
from daemon.slots.errors import ModelError, NoHealthyMember
from surfaces.app import DAEMON, OPTIONS, client_of

if TYPE_CHECKING:
    from daemon.gateway import Answer
    from daemon.service import Daemon

DISCONNECT_POLL_S = 0.25


def openai_error(
    status: int,
    message: str,
    *,
    kind: str,
    code: str | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return web.json_response(body, status=status, headers=headers)


def error_for(err: TallyError) -> web.Response:
    """A TallyError as OpenAI would answer it (status, type, code, Retry-After)."""
    param = err.details.get("param") if isinstance(err.details, dict) else None
    code = err.details.get("code") if isinstance(err.details, dict) else None
    if isinstance(err, InvalidInput):
        return openai_error(400, err.message, kind="invalid_request_error", param=param)
    if isinstance(err, NotFound):
        return openai_error(
            404, err.message, kind="invalid_request_error", code=code or err.code, param=param
        )
    if isinstance(err, Forbidden):
        return openai_error(403, err.message, kind="permission_error", code=err.code)
    if isinstance(err, RateLimited):
        # Retry-After in whole seconds for every client, and OpenAI's own `retry-after-ms`,
        # which its SDKs read first, so a retry waits no longer than the window needs.
        retry = {
            "Retry-After": str(max(1, math.ceil(err.retry_after))),
            "retry-after-ms": str(max(1, math.ceil(err.retry_after * 1000))),
        }
        return openai_error(
            429, err.message, kind="rate_limit_error", code="rate_limit_exceeded", headers=retry
        )
    if isinstance(err, Busy):
        retry = {"Retry-After": str(max(1, math.ceil(err.retry_after)))}
        # A full queue is the caller's rate to slow down (429, which SDKs retry after
        # Retry-After); no member able to serve at all is the service being down (503).
        status = 503 if isinstance(err, NoHealthyMember) else 429
        kind = "server_error" if status == 503 else "rate_limit_error"
        return openai_error(status, err.message, kind=kind, code=err.code, headers=retry)
    if isinstance(err, DeadlineExceeded):
        return openai_error(504, err.message, kind="timeout", code=err.code)
    if isinstance(err, ModelError):
        # The member's own words (llama.cpp: "start it with --embeddings") reach the client,
        # capped; a 4xx is the request's fault, 501 stays "not implemented", the rest is 502.
        upstream = upstream_message(err.details.get("body"))
        message = f"{err.message}: {upstream}" if upstream else err.message
        if 400 <= err.status_code < 500:
            return openai_error(
                err.status_code, message[:2000], kind="invalid_request_error", code=err.code
            )
        status = 501 if err.status_code == 501 else 502
        return openai_error(status, message[:2000], kind="server_error", code=err.code)
    status = err.status
    return openai_error(status, err.message, kind="server_error", code=err.code)


def upstream_message(body: Any) -> str | None:
    """What a member said in its error body: OpenAI's `error.message`, or the text itself."""
    if isinstance(body, dict):
        found = body.get("error")
        if isinstance(found, dict) and isinstance(found.get("message"), str):
            return str(found["message"])[:1000]
        return None
    if not isinstance(body, str) or not body.strip():
        return None
    try:
        data = json.loads(body[:4000]) if body.lstrip().startswith("{") else None
    except (ValueError, RecursionError):  # a cut-off or hostile body: its text, as it came
        data = None
    if isinstance(data, dict):
        found = data.get("error")
        if isinstance(found, dict) and isinstance(found.get("message"), str):
            return str(found["message"])[:1000]
        if isinstance(found, str):
            return found[:1000]
    return body.strip()[:1000]


def _daemon(request: web.Request) -> Daemon:
    return request.app[DAEMON]


def _client(request: web.Request) -> Client:
    return client_of(request) or OWNER


def _refused(client: Client, needed: str) -> web.Response | None:
    if client.allows(needed):  # type: ignore[arg-type]
        return None
    return openai_error(
        403,
        f"client {client.name!r} has scope {client.scope!r}; the gateway needs {needed!r}",
        kind="permission_error",
        code="forbidden",
    )


async def list_models(request: web.Request) -> web.Response:
    refused = _refused(_client(request), "read")
    if refused is not None:
        return refused
    return web.json_response({"object": "list", "data": _daemon(request).gateway.models()})


async def _read(request: web.Request) -> bytes | web.Response:
    try:
        async with asyncio.timeout(request.app[OPTIONS].body_timeout_s):
            return await request.read()
    except TimeoutError:
        response = openai_error(408, "the request body did not arrive", kind="timeout")
        response.force_close()
        return response


class _Stream:
    """The SSE answer of one streamed call, opened by the gateway at its first chunk."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response: web.StreamResponse | None = None

    async def open(self, headers: dict[str, str]) -> None:
        self.response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
                **headers,
            }
        )
        await self.response.prepare(self.request)

    async def send(self, chunk: dict[str, Any]) -> None:
        assert self.response is not None
        data = json.dumps(chunk, ensure_ascii=False, separators=(",", ":"))
        await self.response.write(b"data: " + data.encode() + b"\n\n")

    async def close(self, ok: bool) -> web.StreamResponse:
        assert self.response is not None
        if ok:
            await self.response.write(b"data: [DONE]\n\n")
        await self.response.write_eof()
        return self.response


async def _admitted(request: web.Request) -> tuple[Client, bytes] | web.Response:
    """The caller and its body, if it may call models (`submit`) and the body arrived whole;
    else the OpenAI-shaped refusal."""
    client = _client(request)
    refused = _refused(client, "submit")
    if refused is not None:
        return refused
    raw = await _read(request)
    return raw if isinstance(raw, web.Response) else (client, raw)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    admitted = await _admitted(request)
    if isinstance(admitted, web.Response):
        return admitted
    client, raw = admitted
    stream = _Stream(request)
    handler = asyncio.current_task()
    assert handler is not None
    watcher = _Watch(request, handler)
    try:
        try:
            answer: Answer = await _daemon(request).gateway.chat(
                client, raw, stream.open, stream.send
            )
        finally:
            watcher.cancel()  # from here on the handler only writes: a write notices a gone client
    except TallyError as err:
        if stream.response is None:
            return error_for(err)
        with contextlib.suppress(ConnectionError):  # it failed after the stream began
            await stream.send({"error": _error_body(err)})
            return await stream.close(ok=False)
        return stream.response
    except ConnectionError:  # a write to a client that went away: the call was witnessed so
        return stream.response or web.Response(status=499)
    except asyncio.CancelledError:
        if not watcher.fired or handler.uncancel() > 0:
            raise  # cancelled from elsewhere too (the daemon stopping)
        return stream.response or web.Response(status=499)  # the watcher: nobody to answer
    if stream.response is None:
        return web.Response(
            body=answer.body, content_type="application/json", headers=answer.headers
        )
    with contextlib.suppress(ConnectionError):
        return await stream.close(answer.ok)
    return stream.response


async def embeddings(request: web.Request) -> web.Response:
    admitted = await _admitted(request)
    if isinstance(admitted, web.Response):
        return admitted
    client, raw = admitted
    try:
        answer = await _daemon(request).gateway.embed(client, raw)
    except TallyError as err:
        return error_for(err)
    return web.Response(body=answer.body, content_type="application/json", headers=answer.headers)


def _error_body(err: TallyError) -> dict[str, Any]:
    return {"message": err.message, "type": "server_error", "code": err.code, "param": None}


class _Watch:
    """Cancels the handler's task once the client's connection is gone: a timer that looks
    every `DISCONNECT_POLL_S` (a timer, not a task: most calls end before its first look)."""

    def __init__(self, request: web.Request, handler: asyncio.Task[Any]) -> None:
        self._request, self._handler = request, handler
        self.fired = False
        self._timer = asyncio.get_running_loop().call_later(DISCONNECT_POLL_S, self._look)

    def _look(self) -> None:
        transport = self._request.transport
        if transport is None or transport.is_closing():
            self.fired = True
            self._handler.cancel()
        else:
            self._timer = asyncio.get_running_loop().call_later(DISCONNECT_POLL_S, self._look)

    def cancel(self) -> None:
        self._timer.cancel()


# ---------------------------------------------------------------- the published description

_OPENAI_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
_ERROR_STATUSES = {
    400: "The body is not a valid request (the message names the field)",
    401: "Missing or wrong bearer token (TCP)",
    403: "The client's scope does not allow it, or a cross-origin request",
    404: "No such model (GET /v1/models lists them)",
    408: "The request body did not arrive in time",
    413: "The body is over the daemon's limit",
    421: "The Host header is not this daemon's",
    429: "Over the client's rate limit or token budget, or too many calls waiting: see "
    "Retry-After (and retry-after-ms)",
    501: "The member does not serve this endpoint (its own message says how to enable it)",
    502: "The member failed; its message is passed on, capped",
    503: "No member of the model can serve (down or cooling down), fallbacks included",
    504: "No slot came free before the queue timeout",
}
_MODELS = {
    "type": "object",
    "required": ["object", "data"],
    "properties": {
        "object": {"const": "list"},
        "data": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["id", "object", "created", "owned_by"],
                "properties": {
                    "id": {"type": "string"},
                    "object": {"const": "model"},
                    "created": {"type": "integer"},
                    "owned_by": {"type": "string"},
                },
            },
        },
    },
}
_ANSWER = {
    "type": "object",
    "description": "OpenAI's answer object as the member wrote it, with `model` the id asked "
    "for; the headers X-Tally-Seq and X-Tally-Call-Seq name its ledger entries.",
    "required": ["object"],
}


def openapi_paths() -> tuple[dict[str, Any], dict[str, Any]]:
    """The gateway's operations and the schemas they use, for `/openapi.json`."""
    from daemon.gateway import ChatRequest, EmbeddingRequest

    schemas = {"OpenAIError": _OPENAI_ERROR, **_components(ChatRequest, EmbeddingRequest)}

    def errors(statuses: tuple[int, ...]) -> dict[str, Any]:
        ref = {"$ref": "#/components/schemas/OpenAIError"}
        return {
            str(s): {
                "description": _ERROR_STATUSES[s],
                "content": {"application/json": {"schema": ref}},
            }
            for s in statuses
        }

    calls = (400, 401, 403, 404, 408, 413, 421, 429, 501, 502, 503, 504)

    def post(op: str, summary: str, model: str, streams: bool) -> dict[str, Any]:
        content: dict[str, Any] = {"application/json": {"schema": _ANSWER}}
        if streams:
            content["text/event-stream"] = {
                "schema": {"type": "string", "description": "`data:` chunks, then `[DONE]`"}
            }
        return {
            "post": {
                "operationId": op,
                "tags": ["gateway"],
                "summary": summary,
                "security": [{"bearer": ["submit"]}],
                "requestBody": {
                    "required": True,
                    "content": {
                        "application/json": {"schema": {"$ref": f"#/components/schemas/{model}"}}
                    },
                },
                "responses": {"200": {"description": "OK", "content": content}, **errors(calls)},
            }
        }

    paths = {
        "/v1/models": {
            "get": {
                "operationId": "gateway_models",
                "tags": ["gateway"],
                "summary": "OpenAI's model list: members, then tier:NAME and lane:NAME",
                "security": [{"bearer": ["read"]}],
                "responses": {
                    "200": {
                        "description": "OK",
                        "content": {"application/json": {"schema": _MODELS}},
                    },
                    **errors((401, 403, 421)),
                },
            }
        },
        "/v1/chat/completions": post(
            "gateway_chat",
            "OpenAI chat completions over the slot pool, each call witnessed "
            "(gateway.call, gateway.reply); `[gateway] fallbacks` are tried in order",
            "ChatRequest",
            streams=True,
        ),
        "/v1/embeddings": post(
            "gateway_embeddings",
            "OpenAI embeddings from a member that serves them",
            "EmbeddingRequest",
            streams=False,
        ),
    }
    return paths, schemas


def _components(*models: type[BaseModel]) -> dict[str, Any]:
    """Each model's schema, and the nested ones it refers to, as OpenAPI components."""
    out: dict[str, Any] = {}
    for model in models:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        out.update(schema.pop("$defs", {}))
        out[model.__name__] = schema
    return out


PATHS = frozenset({"/v1/models", "/v1/chat/completions", "/v1/embeddings"})
"""The gateway's endpoints: every error on them is in OpenAI's shape, the guard's included."""

_TYPES = {401: "invalid_request_error", 403: "permission_error", 429: "rate_limit_error"}
_CODES = {401: "invalid_api_key"}


def reshaped(response: web.Response) -> web.Response:
    """A refusal the listeners' guard wrote in tally's shape (`{"error": {"code", "message",
    "details"}}`), in OpenAI's instead, with the same status and headers: an SDK that gets a
    401 or 413 from the gateway reports it as its own error type."""
    try:
        error = json.loads(response.body)["error"]  # type: ignore[arg-type]
        message, code = str(error["message"]), str(error["code"])
    except (TypeError, ValueError, KeyError):
        return response
    status = response.status
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    headers = {k: v for k, v in response.headers.items() if k.lower() in _KEPT}
    return openai_error(status, message, kind=kind, code=_CODES.get(status, code), headers=headers)


_KEPT = frozenset({"www-authenticate", "retry-after", "allow"})


def add_routes(app: web.Application) -> None:
    app.router.add_get("/v1/models", list_models)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/embeddings", embeddings)
