"""The OpenAPI 3.1 document (GET /openapi.json), built from the tool registry's models and
the gateway's paths: it describes exactly the routes the server registers and the statuses
each can answer (plain JSON Schema 2020-12 throughout, which Ajv compiles in strict mode).
"""

from __future__ import annotations

import functools
import json
from typing import TYPE_CHECKING, Any

from aiohttp import web
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from surfaces.gateway import openapi_paths as gateway_openapi
from surfaces.routes import registry

if TYPE_CHECKING:
    from daemon.tools import Tool


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


@functools.cache
def _openapi_body() -> bytes:
    return json.dumps(openapi_document(), ensure_ascii=False).encode()
