"""Errors that cross the tool boundary.

Every error a client may see is a `TallyError`: it carries a stable `code`, the HTTP
status the surfaces answer with, and JSON-safe `details`. Surfaces map errors generically
through these attributes, so no surface needs to know any concrete error class.
"""

from __future__ import annotations

from typing import Any


class TallyError(Exception):
    """Base of every error a client may see; never carries a traceback to the client."""

    code: str = "error"
    status: int = 500

    def __init__(self, message: str, *, details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.details: dict[str, Any] = details or {}


class InvalidInput(TallyError):
    code = "invalid_input"
    status = 422


class InvalidRoster(InvalidInput):
    """A roster that does not load (from `roster.RosterError`: file, line, column, field)."""

    code = "invalid_roster"


class Forbidden(TallyError):
    """The caller may not do this (a path outside what the daemon allows, a missing scope)."""

    code = "forbidden"
    status = 403


class NotFound(TallyError):
    code = "not_found"
    status = 404


class Conflict(TallyError):
    code = "conflict"
    status = 409


class Busy(TallyError):
    """Capacity is exhausted right now; the client should retry after `retry_after` seconds."""

    code = "busy"
    status = 503

    def __init__(
        self, message: str, *, retry_after: float = 1.0, details: dict[str, Any] | None = None
    ) -> None:
        super().__init__(message, details=details)
        self.retry_after = retry_after


class DeadlineExceeded(TallyError):
    code = "deadline_exceeded"
    status = 504


class Unavailable(TallyError):
    """A dependency (a model server, the daemon) is not there."""

    code = "unavailable"
    status = 503
