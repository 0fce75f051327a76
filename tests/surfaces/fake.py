"""A small in-memory stand-in for the Daemon, implementing the contract methods tools call.

Runs move through routing → planning → running → synthesizing → done on a timer, each step a
ledger entry, so SSE, progress and cancellation can be tested without models.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from daemon.errors import Conflict, NotFound
from roster.models import Roster

ROSTER = Roster.model_validate(
    {
        "models": [{"name": "tiny", "command": ["srv", "--port", "{port}"]}],
        "tiers": {"ladder": ["cheap"], "cheap": ["tiny"]},
        "lanes": [
            {"name": "backend", "keywords": ["api", "server"], "tier": "cheap", "system": "b"},
            {"name": "docs", "keywords": ["readme", "docs"], "tier": "cheap", "system": "d"},
        ],
    }
)
TERMINAL = {"done", "failed", "cancelled", "interrupted", "budget_exhausted"}


def _canon(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


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


@dataclass
class LedgerStats:
    appends: int = 0
    batches: int = 0
    fsync_seconds_sum: float = 0.0
    fsync_count: int = 0
    fsync_buckets: list[tuple[float, int]] = field(
        default_factory=lambda: [(0.001, 0), (0.01, 0), (0.1, 0)]
    )


class FakeLedger:
    def __init__(self) -> None:
        self._entries: list[Entry] = []
        self._bodies: dict[str, Any] = {}
        self._subs: list[Callable[[list[Entry]], None]] = []
        self.stats = LedgerStats()

    @property
    def size(self) -> int:
        return len(self._entries)

    async def append(
        self, *, actor: str, kind: str, body: Any = None, run: str | None = None, parent: Any = None
    ) -> Entry:
        body_hash = None
        if body is not None:
            body_hash = hashlib.sha256(_canon(body)).hexdigest()
            self._bodies[body_hash] = body
        prev = self._entries[-1].hash if self._entries else "0" * 64
        e = Entry(
            1, len(self._entries), int(time.time() * 1e6), actor, kind, run, parent, body_hash, prev
        )
        e.hash = hashlib.sha256(b"\0" + _canon(e.__dict__)).hexdigest()
        self._entries.append(e)
        self.stats.appends += 1
        self.stats.batches += 1
        self.stats.fsync_count += 1
        for sub in list(self._subs):
            sub([e])
        return e

    def subscribe(self, cb: Callable[[list[Entry]], None]) -> Callable[[], None]:
        self._subs.append(cb)
        return lambda: self._subs.remove(cb)

    async def get(self, seq: int) -> Entry:
        if not 0 <= seq < len(self._entries):
            raise NotFound(f"no entry {seq}")
        return self._entries[seq]

    async def body(self, body_hash: str) -> Any:
        return self._bodies.get(body_hash)

    async def entries(
        self,
        start: int = 0,
        limit: int = 100,
        kind: str | None = None,
        run: str | None = None,
        actor: str | None = None,
    ) -> list[Entry]:
        out = []
        for e in self._entries[start:]:
            if (kind and e.kind != kind) or (run and e.run != run) or (actor and e.actor != actor):
                continue
            out.append(e)
            if len(out) >= limit:
                break
        return out

    async def causal_chain(self, seq: int) -> list[Entry]:
        chain = [await self.get(seq)]
        while chain[-1].parent is not None:
            chain.append(await self.get(chain[-1].parent))
        return chain[::-1]

    async def verify(self, deep: bool = False) -> dict[str, Any]:
        return {
            "ok": True,
            "size": self.size,
            "root": "ab" * 32,
            "first_bad_seq": None,
            "reason": None,
            "redacted": [],
            "tampered": [],
        }

    async def inclusion_proof(self, seq: int, size: int | None = None) -> dict[str, Any]:
        await self.get(seq)
        return {
            "leaf_index": seq,
            "tree_size": size or self.size,
            "root": "ab" * 32,
            "path": ["cd" * 32],
        }

    async def consistency_proof(self, old: int, new: int | None = None) -> dict[str, Any]:
        if old > self.size:
            raise NotFound("old size beyond the tree")
        return {
            "old_size": old,
            "new_size": new or self.size,
            "old_root": "ab" * 32,
            "new_root": "ef" * 32,
            "path": [],
        }

    async def checkpoint(self) -> dict[str, Any]:
        return {"size": self.size, "root": "ab" * 32, "note": "tally\n"}

    def latest_checkpoint(self) -> dict[str, Any] | None:
        return None

    async def redact(self, body_hash: str, *, actor: str, reason: str) -> Entry:
        if body_hash not in self._bodies:
            raise NotFound("no such body")
        del self._bodies[body_hash]
        return await self.append(
            actor=actor, kind="redaction", body={"body": body_hash, "reason": reason}
        )


@dataclass
class Spent:
    model_calls: int = 0
    tokens: int = 0
    wall_ms: int = 0


@dataclass
class TaskView:
    id: str
    lane: str
    state: str


@dataclass
class RunView:
    id: str
    state: str
    request: str
    lane: str | None = None
    tasks: list[TaskView] = field(default_factory=list)
    answer: str | None = None
    spent: Spent = field(default_factory=Spent)
    budget: dict[str, Any] | None = None
    error: str | None = None
    request_seq: int | None = None
    answer_seq: int | None = None
    created_at_us: int = 0
    updated_at_us: int = 0


@dataclass
class RunEvent:
    seq: int | None
    kind: str
    data: dict[str, Any]


class FakeEngine:
    def __init__(self, ledger: FakeLedger, step_s: float = 0.01, tasks: int = 2) -> None:
        self.ledger = ledger
        self.step_s = step_s
        self.n_tasks = tasks
        self.runs: dict[str, RunView] = {}
        self.deltas: dict[str, list[str]] = {}
        self.cancelled: list[str] = []
        self._jobs: set[asyncio.Task[None]] = set()
        self._changed = asyncio.Event()

    async def _record(self, run: RunView, kind: str, data: dict[str, Any]) -> None:
        e = await self.ledger.append(
            actor="engine", kind=kind, body=data, run=run.id, parent=run.request_seq
        )
        run.updated_at_us = e.ts
        self._poke()

    def _poke(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def submit(self, request: str, **kw: Any) -> RunView:
        run = RunView(id=f"r{len(self.runs) + 1}", state="queued", request=request)
        e = await self.ledger.append(
            actor="user", kind="run.request", body={"request": request}, run=run.id
        )
        run.request_seq = e.seq
        self.runs[run.id] = run
        job = asyncio.create_task(self._drive(run))
        self._jobs.add(job)
        job.add_done_callback(self._jobs.discard)
        return run

    async def _drive(self, run: RunView) -> None:
        for state in ("routing", "planning"):
            await asyncio.sleep(self.step_s)
            if run.state in TERMINAL:
                return
            run.state = state
            await self._record(run, f"run.{state}", {"state": state})
        run.lane = "backend"
        run.tasks = [TaskView(f"T{i + 1}", "backend", "pending") for i in range(self.n_tasks)]
        run.state = "running"
        await self._record(run, "run.running", {"state": "running"})
        for task in run.tasks:
            await asyncio.sleep(self.step_s)
            if run.state in TERMINAL:
                return
            task.state = "done"
            run.spent.model_calls += 1
            run.spent.tokens += 10
            await self._record(run, "task.done", {"task": task.id})
        run.state = "synthesizing"
        await self._record(run, "run.synthesizing", {"state": "synthesizing"})
        for piece in ("hello", " world"):
            await asyncio.sleep(self.step_s)
            self.deltas.setdefault(run.id, []).append(piece)
            self._poke()
        if run.state in TERMINAL:
            return
        run.answer = "hello world"
        run.state = "done"
        await self._record(run, "run.answer", {"answer": run.answer})
        run.answer_seq = self.ledger.size - 1

    def get(self, run_id: str) -> RunView:
        try:
            return self.runs[run_id]
        except KeyError:
            raise NotFound(f"no run {run_id!r}") from None

    def list(self, state: str | None = None, limit: int = 50) -> list[RunView]:
        runs = [r for r in reversed(self.runs.values()) if state is None or r.state == state]
        return runs[:limit]

    async def wait(self, run_id: str, timeout: float | None = None) -> RunView:
        run = self.get(run_id)
        async with asyncio.timeout(timeout):
            while run.state not in TERMINAL:
                await self._changed.wait()
        return run

    async def cancel(self, run_id: str) -> RunView:
        run = self.get(run_id)
        if run.state in TERMINAL:
            raise Conflict(f"run {run_id} is already {run.state}")
        run.state = "cancelled"
        self.cancelled.append(run_id)
        await self._record(run, "run.cancelled", {"state": "cancelled"})
        return run

    async def resume(self, run_id: str) -> RunView:
        run = self.get(run_id)
        if run.state != "interrupted":
            raise Conflict(f"run {run_id} is {run.state}, not interrupted")
        return run

    async def events(self, run_id: str, after: int | None = None) -> AsyncIterator[RunEvent]:
        run = self.get(run_id)
        cursor = -1 if after is None else after
        sent_deltas = 0
        while True:
            changed = self._changed
            news = await self.ledger.entries(start=cursor + 1, limit=1000, run=run_id)
            for e in news:
                if e.kind == "run.answer":  # deltas come before the witnessed answer
                    for piece in self.deltas.get(run_id, [])[sent_deltas:]:
                        sent_deltas += 1
                        yield RunEvent(None, "delta", {"text": piece})
                cursor = e.seq
                yield RunEvent(e.seq, e.kind, {"body": await self.ledger.body(e.body or "")})
            if run.state == "synthesizing":
                for piece in self.deltas.get(run_id, [])[sent_deltas:]:
                    sent_deltas += 1
                    yield RunEvent(None, "delta", {"text": piece})
            if run.state in TERMINAL and not await self.ledger.entries(
                start=cursor + 1, limit=1, run=run_id
            ):
                return
            await changed.wait()


@dataclass
class Route:
    lane: str | None
    confidence: float
    escalate: bool
    scores: list[tuple[str, float]]
    matched: dict[str, list[str]]


class FakeRouter:
    def route(self, text: str) -> Route:
        words = text.lower().split()
        scores = [
            (lane.name, float(sum(w in lane.keywords for w in words))) for lane in ROSTER.lanes
        ]
        scores.sort(key=lambda s: -s[1])
        best = scores[0] if scores[0][1] > 0 else None
        return Route(
            best[0] if best else None,
            1.0 if best else 0.0,
            best is None,
            scores,
            {best[0]: [w for w in words if w in ROSTER.lanes[0].keywords]} if best else {},
        )


class FakePool:
    def status(self) -> dict[str, Any]:
        return {
            "members": {
                "tiny": {
                    "instances": [{"state": "ready", "port": 1, "busy": 0, "idle": 2, "queue": 0}]
                }
            }
        }


class FakeDaemon:
    def __init__(self, step_s: float = 0.01, tasks: int = 2) -> None:
        self.ledger = FakeLedger()
        self.engine = FakeEngine(self.ledger, step_s=step_s, tasks=tasks)
        self.router = FakeRouter()
        self.roster = ROSTER
        self.pool = FakePool()
        self.started = False
        self.stopped = False

    async def start(self) -> None:
        self.started = True

    async def stop(self) -> None:
        self.stopped = True
        for job in list(self.engine._jobs):
            job.cancel()

    async def reload_roster(self, path: Any = None) -> Roster:
        return self.roster
