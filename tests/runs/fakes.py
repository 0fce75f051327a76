"""In-memory stand-ins behind the engine's ports (ledger, pool, router) for fast tests."""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from daemon.ledger.entry import NO_BODY, Body
from daemon.ledger.log import check_append
from daemon.router import Decision, decide
from roster.models import Roster


def canonical(obj: Any) -> bytes:
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode()


@dataclass
class Entry:
    v: int
    seq: int
    ts: int
    actor: str
    kind: str
    run: str | None
    parent: int | None
    body: str | None
    prev: str
    hash: str = ""


class MemoryLedger:
    """The ledger contract in memory: seq order, body hashes, causal chains. It accepts exactly
    what the real one does (`check_append`, shared; `tests/ledger/test_parity.py` proves it)."""

    def __init__(self, delay: float = 0.0) -> None:
        self.log: list[Entry] = []
        self.bodies: dict[str, Any] = {}
        self.delay = delay

    @property
    def size(self) -> int:
        return len(self.log)

    async def append(
        self,
        *,
        actor: str,
        kind: str,
        body: Any = None,
        run: str | None = None,
        parent: int | None = None,
        on_commit: Callable[[Any], None] | None = None,
    ) -> Entry:
        data = check_append(
            actor=actor, kind=kind, body=body, run=run, parent=parent, size=len(self.log)
        )
        digest = None
        if data is not None:
            digest = hashlib.sha256(data).hexdigest()
            self.bodies[digest] = json.loads(data)
        prev = self.log[-1].hash if self.log else "0" * 64
        entry = Entry(
            1, len(self.log), time.time_ns() // 1000, actor, kind, run, parent, digest, prev
        )
        entry.hash = hashlib.sha256(
            b"\x00" + canonical(entry.__dict__ | {"hash": None})
        ).hexdigest()
        self.log.append(entry)
        if on_commit is not None:
            on_commit(entry)
        if self.delay:  # the fsync's wait: the entry is committed whether it ends or not
            await asyncio.sleep(self.delay)
        return entry

    async def get(self, seq: int) -> Entry:
        return self.log[seq]

    async def body(self, body_hash: str | None) -> Body:
        if body_hash is None:
            return NO_BODY
        if body_hash not in self.bodies:
            return Body("missing")
        return Body("present", self.bodies[body_hash])

    async def read_bodies(self, hashes: Sequence[str | None]) -> list[Body]:
        return [await self.body(h) for h in hashes]

    async def entries(
        self,
        start: int = 0,
        limit: int = 100,
        kind: str | None = None,
        run: str | None = None,
        actor: str | None = None,
        in_run: bool = False,
    ) -> list[Entry]:
        out = []
        for entry in self.log[start:]:
            if in_run and entry.run is None:
                continue
            if kind is not None and entry.kind != kind:
                continue
            if run is not None and entry.run != run:
                continue
            if actor is not None and entry.actor != actor:
                continue
            out.append(entry)
            if len(out) >= limit:
                break
        return out

    async def causal_chain(self, seq: int) -> list[Entry]:
        chain = [self.log[seq]]
        while chain[-1].parent is not None:
            chain.append(self.log[chain[-1].parent])
        return list(reversed(chain))

    def kinds(self, run: str | None = None) -> list[str]:
        return [e.kind for e in self.log if run is None or e.run == run]

    def bodies_of(self, kind: str, run: str | None = None) -> list[Any]:
        return [
            self.bodies.get(e.body or "")
            for e in self.log
            if e.kind == kind and (run is None or e.run == run)
        ]


@dataclass
class Usage:
    prompt_tokens: int = 10
    completion_tokens: int = 5
    cached_tokens: int = 0


@dataclass
class ChatResult:
    text: str
    finish_reason: str = "stop"
    usage: Usage = field(default_factory=Usage)
    timings: dict[str, Any] = field(default_factory=lambda: {"prompt_ms": 1.5})
    member: str = ""
    instance: int = 0
    id_slot: int = 0
    request: dict[str, Any] = field(default_factory=dict)
    model: str = "fake"
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


Script = Callable[[str, list[dict[str, Any]]], Any]
"""(member, messages) -> reply text (or an awaitable of it, or an exception to raise)."""


class FakeLease:
    def __init__(self, pool: ScriptedPool, member: str, slot: int) -> None:
        self.pool = pool
        self.member = member
        self.instance = 0
        self.id_slot = slot

    def request(
        self,
        messages: list[dict[str, Any]],
        max_tokens: int = 256,
        response_format: dict[str, Any] | None = None,
        *,
        stream: bool = False,
    ) -> dict[str, Any]:
        return {"messages": messages, "max_tokens": max_tokens, "temperature": 0.2}

    async def chat(
        self,
        messages: list[dict[str, Any]],
        max_tokens: int = 256,
        response_format: dict[str, Any] | None = None,
        on_delta: Callable[[str], Any] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> ChatResult:
        self.pool.calls.append((self.member, messages))
        self.pool.in_flight += 1
        try:
            reply = self.pool.script(self.member, messages)
            if asyncio.iscoroutine(reply):
                reply = await reply
            if isinstance(reply, BaseException):
                raise reply
        except asyncio.CancelledError:
            self.pool.aborted += 1
            raise
        finally:
            self.pool.in_flight -= 1
        text = str(reply)
        if on_delta is not None:
            for word in text.split(" "):
                on_delta(word + " ")
        return ChatResult(
            text=text,
            member=self.member,
            id_slot=self.id_slot,
            request={"messages": messages, "max_tokens": max_tokens, "temperature": 0.2},
        )

    async def send(self, body: dict[str, Any]) -> ChatResult:
        """A body sent as is (the agent loop's way): the script answers its messages."""
        return await self.chat(list(body.get("messages") or []), int(body.get("max_tokens", 256)))


class ScriptedPool:
    """Leases tier/member targets; replies come from a script function."""

    def __init__(self, roster: Roster, script: Script, slots: int = 4) -> None:
        self.roster = roster
        self.script = script
        self.calls: list[tuple[str, list[dict[str, Any]]]] = []
        self.aborted = 0
        self.in_flight = 0
        self.leases: list[tuple[str, str | None]] = []
        self._sem = asyncio.Semaphore(slots)

    def _member(self, target: str) -> str:
        if target in self.roster.tiers.members:
            return self.roster.tiers.members[target][0]
        return target

    @asynccontextmanager
    async def lease(
        self,
        target: str,
        priority: int = 0,
        deadline: float | None = None,
        affinity: str | None = None,
    ) -> AsyncIterator[FakeLease]:
        async with self._sem:
            self.leases.append((target, affinity))
            yield FakeLease(self, self._member(target), len(self.leases) % 4)


@dataclass
class Route:
    lane: str | None
    confidence: float
    escalate: bool
    scores: list[tuple[str, float]]
    matched: dict[str, list[str]]
    decision: Decision


class KeywordRouter:
    """Picks the lane whose name appears in the text; escalates when none does. What submit
    then does is the real `daemon.router.decide`, as with the real router."""

    def __init__(self, roster: Roster) -> None:
        self.roster = roster
        self.lanes = [lane.name for lane in roster.lanes]

    def route(self, text: str) -> Route:
        hits = [lane for lane in self.lanes if lane in text.lower()]
        if hits:
            decision = decide(self.roster, hits[0], hits)
            return Route(hits[0], 0.9, False, [(hits[0], 0.9)], {hits[0]: [hits[0]]}, decision)
        scores = [(lane, 0.1) for lane in self.lanes]
        return Route(None, 0.0, True, scores, {}, decide(self.roster, None, self.lanes))


def make_roster(**policy: Any) -> Roster:
    return Roster.model_validate(
        {
            "policy": {"max_parallel": 4, **policy},
            "models": [
                {"name": "tiny", "url": "http://127.0.0.1:1/v1"},
                {"name": "big", "url": "http://127.0.0.1:2/v1"},
                {"name": "coord", "url": "http://127.0.0.1:3/v1"},
            ],
            "tiers": {
                "ladder": ["cheap", "capable"],
                "cheap": ["tiny"],
                "capable": ["big"],
                "planner": ["coord"],
            },
            "lanes": [
                {
                    "name": "backend",
                    "keywords": ["api"],
                    "tier": "cheap",
                    "system": "You build APIs.",
                },
                {"name": "docs", "keywords": ["doc"], "tier": "cheap", "system": "You write docs."},
                {"name": "testing", "keywords": ["test"], "tier": "cheap", "system": "You test."},
            ],
        }
    )
