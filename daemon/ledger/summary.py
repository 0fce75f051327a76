"""Aggregates over the record: entry counts, model usage, clients and gateway traffic.

Contract. `summarize` reads the acknowledged entries in seq order, once, and only the bodies of
the kinds it counts; it never writes, and what it returns depends on the record alone (run it
twice on the same ledger, get the same summary). The ledger does not know what the kinds mean:
the caller names them in a `Vocabulary`, so this module stays below the engine and the gateway
(data flows one way) while the aggregation lives beside the record it reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from pydantic import ValidationError

from daemon.ledger.entry import Body, Entry
from daemon.record import Body as Typed
from daemon.record import GatewayReply, ModelCall, ModelReply, RunRequest, RunRoute, RunState

T = TypeVar("T", bound=Typed)

PAGE = 1000  # entries per read (and their bodies in one more hop)


class Readable(Protocol):
    """What `summarize` needs of a ledger."""

    async def entries(
        self, start: int = 0, limit: int = 100, kind: str | None = None, run: str | None = None
    ) -> list[Entry]: ...

    async def read_bodies(self, hashes: Sequence[str | None]) -> list[Body]: ...


@dataclass(frozen=True, slots=True)
class Vocabulary:
    """The entry kinds (and actors) a summary reads, as their writers name them."""

    request: str
    route: str
    state: str
    model_call: str
    model_reply: str
    gateway_reply: str
    system: frozenset[str]
    """Actors that are tally itself: their entries belong to no client unless in a run."""

    @property
    def reads(self) -> frozenset[str]:
        """The kinds whose bodies are read; every other entry is counted by kind only."""
        return frozenset(
            {
                self.model_call,
                self.model_reply,
                self.route,
                self.state,
                self.request,
                self.gateway_reply,
            }
        )


@dataclass(slots=True)
class MemberTotals:
    calls: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    ms: int = 0


@dataclass(slots=True)
class ClientTotals:
    runs: int = 0
    entries: int = 0


@dataclass(slots=True)
class GatewayTotals:
    calls: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ms: int = 0


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _typed(model: type[T], body: object) -> T | None:
    """The body as its kind's model; None for one that is absent (redacted) or does not fit
    (`tally ledger verify --deep` names it), whose fields are then not counted: a summary
    counts what the record says for certain, and the entry itself is still counted by kind."""
    try:
        return model.read(body)
    except ValidationError:
        return None


@dataclass
class Summary:
    """Accumulates from entries in seq order (`add`); bodies only of `Vocabulary.reads`."""

    words: Vocabulary
    by_client: dict[str, ClientTotals] = field(default_factory=dict)
    run_client: dict[str, str] = field(default_factory=dict)
    count: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    members: dict[str, MemberTotals] = field(default_factory=dict)
    by_purpose: dict[str, int] = field(default_factory=dict)
    route_escalations: int = 0
    states: dict[str, int] = field(default_factory=dict)
    calls: dict[int, int] = field(default_factory=dict)  # model.call seq -> its ts, until replied
    gateway: dict[str, dict[str, GatewayTotals]] = field(default_factory=dict)

    def member(self, name: Any) -> MemberTotals:
        return self.members.setdefault(str(name or "unknown"), MemberTotals())

    def client_of(self, entry: Entry, body: Any) -> str | None:
        """Whose doing an entry is: its run's submitter, or the client that is its actor."""
        if entry.kind == self.words.request and entry.run is not None:
            request = _typed(RunRequest, body)
            who = None if request is None else request.client
            self.run_client[entry.run] = who or "unknown"  # runs from before clients
        if entry.run is not None:
            return self.run_client.get(entry.run)
        return None if entry.actor in self.words.system else str(entry.actor)

    def attribute(self, client: str | None, entry: Entry) -> None:
        if client is None:
            return
        usage = self.by_client.setdefault(client, ClientTotals())
        usage.entries += 1
        usage.runs += entry.kind == self.words.request

    def add(self, entry: Entry, body: Any) -> None:
        words = self.words
        self.count += 1
        self.by_kind[entry.kind] = self.by_kind.get(entry.kind, 0) + 1
        if not isinstance(body, dict):
            return
        if entry.kind == words.model_call:
            call = _typed(ModelCall, body)
            self.member(None if call is None else call.member).calls += 1
            purpose = (None if call is None else call.purpose) or "unknown"
            self.by_purpose[purpose] = self.by_purpose.get(purpose, 0) + 1
            self.calls[entry.seq] = entry.ts
        elif entry.kind == words.model_reply:
            reply = _typed(ModelReply, body)
            if reply is None:
                return
            m = self.member(reply.member)
            if reply.usage is not None:  # an error reply reports none
                m.prompt_tokens += reply.usage.prompt_tokens or 0
                m.completion_tokens += reply.usage.completion_tokens or 0
                m.cached_tokens += reply.usage.cached_tokens or 0
            m.errors += reply.error is not None
            called = self.calls.pop(entry.parent, None) if entry.parent is not None else None
            if called is not None:
                m.ms += max(0, entry.ts - called) // 1000
        elif entry.kind == words.route:
            route = _typed(RunRoute, body)
            self.route_escalations += route is not None and route.escalate
        elif entry.kind == words.state:
            ended = _typed(RunState, body)
            state = "unknown" if ended is None else ended.state
            self.states[state] = self.states.get(state, 0) + 1
        elif entry.kind == words.gateway_reply:
            self.gateway_reply(body)

    def gateway_reply(self, body: dict[str, Any]) -> None:
        reply = _typed(GatewayReply, body)
        if reply is None:
            return
        models = self.gateway.setdefault(reply.client, {})
        usage = models.setdefault(reply.model, GatewayTotals())
        if reply.error is not None:
            usage.errors += 1
            return
        usage.calls += 1
        prompt, completion = reply.tokens()  # an error reply's `usage` is null: see tokens
        usage.prompt_tokens += prompt
        usage.completion_tokens += completion
        usage.ms += reply.duration_us // 1000


async def summarize(
    ledger: Readable, words: Vocabulary, *, run: str | None = None, client: str | None = None
) -> Summary:
    """One pass over the record (or one run's entries), `PAGE` entries per read; `client`
    keeps only what that client caused."""
    acc = Summary(words)
    reads = words.reads
    start = 0
    while True:
        batch = await ledger.entries(start=start, limit=PAGE, run=run)
        wanted = [e.body if e.kind in reads else None for e in batch]
        for e, (_, body) in zip(batch, await ledger.read_bodies(wanted), strict=True):
            whose = acc.client_of(e, body)
            if client is not None and whose != client:
                continue
            acc.attribute(whose, e)
            acc.add(e, body)
        if len(batch) < PAGE:
            return acc
        start = batch[-1].seq + 1
