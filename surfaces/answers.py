"""What every route answers alike: the error body (`{"error": {"code", "message",
"details"}}`, never a traceback), a validation error's details, and one server-sent event."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web
from pydantic import ValidationError
from pydantic_core import to_jsonable_python


def error_response(
    status: int, code: str, message: str, details: Any = None, headers: dict[str, str] | None = None
) -> web.Response:
    body = {"error": {"code": code, "message": message, "details": details or {}}}
    return web.json_response(body, status=status, headers=headers)


def http_code(status: int) -> str:
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


def sse_frame(kind: str, data: Any, seq: int | None = None) -> bytes:
    head = f"id: {seq}\n" if seq is not None else ""
    payload = json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    return f"{head}event: {kind}\ndata: {payload}\n\n".encode()
