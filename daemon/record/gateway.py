"""The kinds the OpenAI-compatible gateway writes (actor: the calling client's name).

A call is witnessed before it goes out (`gateway.call`) and its outcome after
(`gateway.reply`, parent: the call). The client's request and the answer are kept by their
SHA-256 and size; their text only with `[gateway] bodies = "store"`.
"""

from __future__ import annotations

from typing import Any, ClassVar

from daemon.record.body import CLIENT, Body, Part


class GatewayCall(Body):
    """`target` is "tier:<name>", "lane:<name>" or "member:<name>"; `upstream` what tally
    changed in the body it sent (`safe`); `prepended` the lane's system prompt it added."""

    KIND: ClassVar[str] = "gateway.call"
    ACTORS: ClassVar[tuple[str, ...]] = (CLIENT,)

    client: str
    endpoint: str
    model: str
    target: str
    member: str
    instance: int
    slot: int
    attempt: int
    stream: bool
    affinity: str | None
    queue_wait_us: int
    request_sha256: str
    request_bytes: int
    request: str | None
    prepended: str | None
    upstream: dict[str, Any] | None


class GatewayUsage(Part):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


class GatewayReply(Body):
    """A gateway call's outcome. An error reply (`error` set) has `usage` null: the server
    reported nothing; `tokens()` reads both alike."""

    KIND: ClassVar[str] = "gateway.reply"
    ACTORS: ClassVar[tuple[str, ...]] = (CLIENT,)
    PARENTS: ClassVar[tuple[str, ...]] = ("gateway.call",)

    client: str
    model: str
    member: str
    instance: int
    slot: int
    finish_reason: str | None
    usage: GatewayUsage | None
    timings: dict[str, int]
    ttft_us: int | None
    duration_us: int
    text_sha256: str | None
    response_sha256: str | None
    response_bytes: int
    response: str | None
    error: str | None

    def tokens(self) -> tuple[int, int]:
        """(prompt, completion) tokens; (0, 0) for an error reply."""
        if self.usage is None:
            return 0, 0
        return self.usage.prompt_tokens, self.usage.completion_tokens


class GatewayFallback(Body):
    """The member or tier asked for (`failed`) could not serve; `next` is tried (null: none)."""

    KIND: ClassVar[str] = "gateway.fallback"
    ACTORS: ClassVar[tuple[str, ...]] = (CLIENT,)

    client: str
    model: str
    failed: str
    error: str
    code: str
    next: str | None


class ClientLimited(Body):
    """A client was refused by its limits (429), witnessed at most once a minute per limit."""

    KIND: ClassVar[str] = "client.limited"
    ACTORS: ClassVar[tuple[str, ...]] = (CLIENT,)

    client: str
    limit: str
    allowed: int
    used: int
    retry_after_ms: int
    surface: str
