"""The engine's view of the parts below it (ledger, slot pool, router), as protocols.

The engine needs only these few operations; stating them here keeps it testable with
in-memory fakes and keeps the dependency one-way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol, runtime_checkable

from daemon.ledger.entry import Body


class EntryLike(Protocol):
    """The fields of a ledger entry that the engine and replay read."""

    @property
    def seq(self) -> int: ...
    @property
    def ts(self) -> int: ...
    @property
    def kind(self) -> str: ...
    @property
    def run(self) -> str | None: ...
    @property
    def body(self) -> str | None: ...
    @property
    def parent(self) -> int | None: ...


class LedgerReader(Protocol):
    """What replay needs: it reads and never writes."""

    async def entries(
        self,
        start: int = 0,
        limit: int = 100,
        kind: str | None = None,
        run: str | None = None,
        actor: str | None = None,
        in_run: bool = False,
    ) -> Sequence[EntryLike]: ...

    async def body(self, body_hash: str | None) -> Body: ...

    async def read_bodies(self, hashes: Sequence[str | None]) -> list[Body]: ...


class LedgerPort(LedgerReader, Protocol):
    """What the engine needs: replay's reads, appends, and the size a snapshot is stamped with."""

    @property
    def size(self) -> int: ...

    async def append(
        self,
        *,
        actor: str,
        kind: str,
        body: Any = None,
        run: str | None = None,
        parent: int | None = None,
        on_commit: Callable[[Any], None] | None = None,
    ) -> EntryLike: ...


class UsageLike(Protocol):
    """Token counts a model server reported."""

    @property
    def prompt_tokens(self) -> int: ...
    @property
    def completion_tokens(self) -> int: ...
    @property
    def cached_tokens(self) -> int: ...


class ChatReply(Protocol):
    """What a chat call returns, as far as the engine reads it (the pool's `Completion`)."""

    @property
    def text(self) -> str: ...
    @property
    def finish_reason(self) -> str | None: ...
    @property
    def usage(self) -> UsageLike: ...
    @property
    def timings(self) -> Mapping[str, Any]: ...


class DecisionLike(Protocol):
    """What submit does with a route (`daemon.router.Decision`)."""

    @property
    def lane(self) -> str | None: ...
    @property
    def source(self) -> str: ...
    @property
    def classifier(self) -> str | None: ...
    @property
    def candidates(self) -> Sequence[str]: ...


class RouteResult(Protocol):
    """The router's decision (`daemon.router.Route`), as the engine witnesses it."""

    @property
    def decision(self) -> DecisionLike: ...

    @property
    def lane(self) -> str | None: ...
    @property
    def confidence(self) -> float: ...
    @property
    def escalate(self) -> bool: ...
    @property
    def scores(self) -> Sequence[tuple[str, float]]: ...
    @property
    def matched(self) -> Mapping[str, Sequence[str]]: ...


class SentReply(ChatReply, Protocol):
    """What sending a request body as is returns (the pool's `Completion`): a chat reply and
    the tool calls it made (OpenAI `tool_calls`; empty when it made none)."""

    @property
    def tool_calls(self) -> list[dict[str, Any]]: ...


class LeasePort(Protocol):
    """One leased slot (the pool's `Lease`). `chat` for a task's call; `request` and `send` for
    a caller that shapes the body itself (the agent loop: its `tools`, its `tool_choice`)."""

    member: str
    instance: int
    id_slot: int

    def request(
        self,
        messages: list[dict[str, Any]],
        max_tokens: int = 256,
        response_format: dict[str, Any] | None = None,
        *,
        stream: bool = False,
    ) -> dict[str, Any]: ...

    async def chat(
        self,
        messages: list[dict[str, Any]],
        max_tokens: int = 256,
        response_format: dict[str, Any] | None = None,
        on_delta: Callable[[str], Any] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> ChatReply: ...

    async def send(self, body: dict[str, Any]) -> SentReply:
        """POST `body` as is (`request`'s, amended) to this slot's server."""
        ...


class PoolPort(Protocol):
    def lease(
        self,
        target: str,
        priority: int = 0,
        deadline: float | None = None,
        affinity: str | None = None,
    ) -> AbstractAsyncContextManager[LeasePort]: ...


class RouterPort(Protocol):
    def route(self, text: str) -> RouteResult: ...


@runtime_checkable
class EmbeddingRouter(Protocol):
    """A router that may ask an embedding member (`daemon.router.Router.aroute`)."""

    async def aroute(self, text: str, wait: float = 0.0) -> Any: ...
