"""Errors the slot pool raises; each maps to an HTTP status through `TallyError`."""

from __future__ import annotations

from typing import Any

from daemon.errors import Busy, DeadlineExceeded, NotFound, Unavailable


class PoolBusy(Busy):
    """The member's waiting queue is full, or the member is cooling down."""

    code = "pool_busy"


class NoHealthyMember(PoolBusy):
    """No member of the target can take a lease: each is cooling down or unreachable.

    The message names every member and why; `details["members"]` maps name → reason.
    It is a PoolBusy, so callers that retry on busy retry after `retry_after` (the next
    probe or the end of the cooldown).
    """

    code = "no_healthy_member"


class PoolTimeout(DeadlineExceeded):
    """No slot came free before the caller's deadline."""

    code = "pool_timeout"


class SlotLost(Unavailable):
    """The server under an in-flight lease died or hung; the caller may retry or escalate."""

    code = "slot_lost"


class NoSuchTarget(NotFound):
    """The lease target names neither a tier nor a member."""

    code = "no_such_target"


class ModelError(Unavailable):
    """The model server answered a request with an error status (the slot itself is fine)."""

    code = "model_error"

    def __init__(
        self, message: str, *, status_code: int, details: dict[str, Any] | None = None
    ) -> None:
        super().__init__(message, details={"status_code": status_code, **(details or {})})
        self.status_code = status_code


class ServerStartError(Unavailable):
    """A model server did not become ready; `details["log_tail"]` holds the end of its log."""

    code = "server_start_failed"


class ConsumerGone(Exception):
    """The caller's own chunk callback failed (its client went away): not the server's fault.

    Raised instead of whatever the callback raised, so a write error of the caller's client
    (aiohttp's ClientConnectionResetError is an aiohttp.ClientError too) is never taken for a
    lost connection to the model server; the upstream request is cut all the same."""


class BadReply(ModelError):
    """The member answered what no model server should: JSON that does not parse or nests too
    deep, or (`ReplyTooLarge`) more bytes than the request could need. The member's fault: the
    call fails (502), the member's `last_error` says why, and the daemon goes on."""

    code = "bad_reply"
    status = 502

    def __init__(self, message: str, details: dict[str, Any] | None = None) -> None:
        super().__init__(message, status_code=502, details=details)


class ReplyTooLarge(BadReply):
    """A reply past its cap: `max_tokens` × REPLY_TOKEN_BYTES + REPLY_OVERHEAD, at most the
    member's `max_reply_mb`."""

    code = "reply_too_large"
