"""The runs engine: submit → route → plan → dispatch → validate → escalate → synthesize → answer.

Every step is witnessed in the ledger with a causal parent (see `daemon.runs.entries`), and
the live run state is the replay reducer applied to exactly those entries, so what a client
reads and what replay rebuilds are the same thing. Run state is kept in memory (O(1) reads);
finished runs beyond `[policy] keep_runs` are compacted to summaries, summaries beyond
`keep_summaries` more are dropped, and `find()` / `detail()` read such a run back from the
ledger. Idempotency keys live `key_ttl_s` (24 h) and at most `max_keys` of them are kept.
Each view's snapshot encoding is cached until the view changes, so a snapshot costs the loop
only the runs that changed since the last one.
"""

from __future__ import annotations

import asyncio
import builtins
import collections
import contextlib
import heapq
import itertools
import logging
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from daemon.errors import Busy, Conflict, InvalidInput, NotFound
from daemon.planning import Plan, Task, check_plan
from daemon.runs import checks, guard
from daemon.runs import entries as k
from daemon.runs.budget import BudgetExhausted, Meter, limits
from daemon.runs.dispatch import Capacity, Node, dispatch, levels
from daemon.runs.executors import Stub, chat_messages, clip, echo_stub, run_command, upstream_block
from daemon.runs.ports import ChatReply, EntryLike, LedgerPort, PoolPort, RouterPort
from daemon.runs.repetition import cut_loop
from daemon.runs.replay import RedactedAfterSnapshot, apply, replay
from daemon.runs.sandbox import Confinement, admit_commands
from daemon.runs.snapshot import Snapshot
from daemon.runs.state import FINAL, STOPPED, Census, Limits, RunEvent, RunView, Summaries
from daemon.slots.records import ledger_timings
from roster.models import Budget, Lane, Roster

log = logging.getLogger(__name__)

Watcher = Callable[[EntryLike, dict[str, Any]], None]
"""Sees each run entry the engine witnesses (seq, ts, kind, run, parent) with its body."""

RESULT_CAP = 64 * 1024
"""A task output kept in the record and in memory is cut to this many characters."""


class TaskFailed(Exception):
    pass


@dataclass
class _Run:
    """What only a running run needs (its view lives in Engine._views)."""

    id: str
    meter: Meter
    task: asyncio.Task[None] | None = None
    started: asyncio.Event = field(default_factory=asyncio.Event)
    cancelling: bool = False
    interrupting: bool = False
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    outputs: dict[str, str] = field(default_factory=dict)
    client_plan: Plan | None = None
    fresh: bool = True


RUN_ID = re.compile(r"r[0-9a-f]{15}")
"""What `submit` names a run: an id of another shape was never a run of this daemon."""


@dataclass(frozen=True)
class EngineOptions:
    max_tasks: int = 256
    """Tasks in flight across every run (the daemon-wide cap)."""
    coordinator: str | None = None
    """Tier or member asked to plan when the client gives no plan; None = the roster's policy."""
    judge: str | None = None
    """Tier or member asked to judge a task's output; None = the roster's policy."""
    command_timeout_s: float = 60.0
    confinement: Confinement = field(default_factory=Confinement)
    """Paths no command task may see and where task dirs go (the daemon's own dirs)."""
    max_tokens: int = 512
    guard_attempts: int = 3
    key_ttl_s: float = 86_400.0
    """How long an Idempotency-Key keeps returning its run; after that it starts a new one."""
    max_keys: int = 100_000
    """Idempotency keys remembered at once; past this the oldest are forgotten first."""


class Engine:
    def __init__(
        self,
        ledger: LedgerPort,
        pool: PoolPort,
        roster: Roster,
        router: RouterPort,
        *,
        options: EngineOptions | None = None,
        stub: Stub = echo_stub,
    ) -> None:
        self.ledger = ledger
        self.pool = pool
        self.router = router
        self.options = options or EngineOptions()
        self.stub = stub
        self._views: dict[str, RunView] = {}
        """Runs in flight and the newest `keep_runs` finished ones, in full."""
        self._summaries = Summaries()
        self._scans = asyncio.Semaphore(1)
        """Read-backs of runs memory no longer holds: whole-ledger scans, one at a time."""
        """Finished runs past `keep_runs`: their summaries, up to `keep_summaries`."""
        self.census = Census()
        self._runs: dict[str, _Run] = {}
        # Idempotency-Key -> (its run id, once witnessed; when it was made, wall-clock s),
        # oldest first: bounded by max_keys, each forgotten after key_ttl_s.
        self._keys: collections.OrderedDict[str, tuple[asyncio.Future[str], float]] = (
            collections.OrderedDict()
        )
        self._listeners: dict[str, set[asyncio.Queue[RunEvent]]] = {}
        self._watchers: builtins.list[Watcher] = []
        self._finished: OrderedDict[str, None] = OrderedDict()
        """Finished runs in full, oldest first (bounded by `keep_runs`)."""
        self._compacted: OrderedDict[str, None] = OrderedDict()
        """Every finished run still in memory, oldest first (`keep_runs + keep_summaries`)."""
        self._closing = False
        self._appending = 0
        self._appending_requests = 0
        """Submits admitted whose request entry is not applied yet (not in the census)."""
        """Run entries being appended and not yet applied: a snapshot needs none in between."""
        self.restored_from: int | None = None
        """The ledger size of the snapshot the last restore() continued from (None: full)."""
        self.set_roster(roster)

    # ---------------------------------------------------------------- configuration

    @property
    def _coordinator(self) -> str | None:
        return self.options.coordinator or self.roster.policy.coordinator

    @property
    def _classifier(self) -> str | None:
        """The roster's classifier, if it is stronger than the lanes' first rung: a tier whose
        members all serve the first rung too would add a model call and no judgment."""
        name = self.roster.policy.classifier
        if name is None:
            return None
        tiers = self.roster.tiers
        members = set(tiers.members.get(name, [name]))
        first = set(tiers.members.get(tiers.ladder[0], []))
        return name if members - first else None

    @property
    def _judge_target(self) -> str | None:
        return self.options.judge or self.roster.policy.judge

    def set_roster(self, roster: Roster) -> None:
        """Use a new roster for runs that start from now on."""
        self.roster = roster
        self._lanes = {lane.name: lane for lane in roster.lanes}
        self._run_gate = asyncio.Semaphore(roster.policy.max_runs)
        self.capacity = Capacity(
            self.options.max_tasks,
            {lane.name: lane.max_concurrency for lane in roster.lanes if lane.max_concurrency},
        )

    # ---------------------------------------------------------------- reading

    def get(self, run_id: str) -> RunView:
        """The run as memory holds it: in full, or its summary (see `find`)."""
        view = self._views.get(run_id)
        if view is not None:
            return view.model_copy(deep=True)
        summary = self._summaries.get(run_id)
        if summary is None:
            raise NotFound(f"no run {run_id}", details={"run": run_id})
        return summary

    def list(self, state: str | None = None, limit: int = 50) -> builtins.list[RunView]:
        """The newest `limit` runs in memory (with this state), newest first."""
        full = (
            (v.created_at_us, v.id)
            for v in self._views.values()
            if state is None or v.state == state
        )
        newest = heapq.nlargest(limit, itertools.chain(full, self._summaries.newest(state, limit)))
        return [self.get(run_id) for _, run_id in newest]

    async def find(self, run_id: str) -> RunView:
        """The run in full: from memory, or read back from the ledger when memory holds only
        its summary (the plan, results and full texts are in the record) or nothing at all."""
        view = self._views.get(run_id)
        if view is not None and not view.summary:
            return view.model_copy(deep=True)
        held = view or self._summaries.get(run_id)
        if held is not None:  # its entries start at its request: no scan of what came before
            found = (await replay(self.ledger, start=held.request_seq, run=run_id)).get(run_id)
            return found or held
        if not RUN_ID.fullmatch(run_id):  # no run was ever named so: nothing to scan for
            raise NotFound(f"no run {run_id}", details={"run": run_id})
        # Not in memory: a scan of the whole ledger (in a thread). One at a time, so a client
        # asking for many unknown runs queues behind itself instead of taking every core.
        async with self._scans:
            found = (await replay(self.ledger, run=run_id)).get(run_id)
        if found is None:
            raise NotFound(f"no run {run_id}", details={"run": run_id})
        return found

    async def wait(self, run_id: str, timeout: float | None = None) -> RunView:
        if run_id not in self._views:
            return await self.find(run_id)
        ctx = self._runs.get(run_id)
        if ctx is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await ctx.finished.wait()
        return self.get(run_id)

    async def events(self, run_id: str, after: int | None = None) -> AsyncIterator[RunEvent]:
        """The run's ledger entries after `after` (plus answer `delta`s), to its stop state."""
        view = await self.find(run_id)
        queue: asyncio.Queue[RunEvent] = asyncio.Queue()
        self._listeners.setdefault(run_id, set()).add(queue)
        try:
            last = -1 if after is None else after
            start = view.request_seq if after is None else after + 1
            while True:
                batch = await self.ledger.entries(start=start, limit=500, run=run_id)
                bodies = await self.ledger.read_bodies([entry.body for entry in batch])
                for entry, (_, body) in zip(batch, bodies, strict=True):
                    last = entry.seq
                    yield RunEvent(seq=entry.seq, kind=entry.kind, data=body)
                if len(batch) < 500:
                    break
                start = batch[-1].seq + 1
            live = self._views.get(run_id)
            if (live is None or live.state in STOPPED) and run_id not in self._runs:
                return
            while True:
                event = await queue.get()
                if event.seq is not None:
                    if event.seq <= last:
                        continue
                    last = event.seq
                yield event
                if _ends(event) and run_id not in self._runs:
                    return
        finally:
            listeners = self._listeners.get(run_id)
            if listeners is not None:
                listeners.discard(queue)
                if not listeners:
                    del self._listeners[run_id]

    def watch(self, watcher: Watcher) -> Callable[[], None]:
        """Call `watcher(entry, body)` after every entry the engine witnesses
        (metrics, traces, the console's run feed); returns the function that stops it."""
        self._watchers.append(watcher)
        return lambda: self._watchers.remove(watcher) if watcher in self._watchers else None

    # ---------------------------------------------------------------- control

    async def submit(
        self,
        request: str,
        plan: Plan | dict[str, Any] | None = None,
        lane: str | None = None,
        budget: Budget | Limits | dict[str, Any] | None = None,
        idempotency_key: str | None = None,
        max_parallel: int | None = None,
        barrier: bool = False,
        client: str = "owner",
    ) -> RunView:
        """Create a run and start driving it; returns once the request is witnessed."""
        if self._closing:  # 503 with Retry-After: a restarted daemon takes it
            raise Busy("the daemon is stopping; retry once it is back", retry_after=5.0)
        known = self._key(idempotency_key)
        if known is not None:
            run_id = await asyncio.shield(known)
            existing = await self.find(run_id)
            if existing.request != request:
                raise Conflict(
                    "this Idempotency-Key was used for a different request",
                    details={"run": run_id},
                )
            return existing
        if not request.strip(" \t\n\r\f\v") and plan is None:  # the `submit` schema's rule
            raise InvalidInput("the request is empty")
        if lane is not None and lane not in self._lanes:
            raise NotFound(f"no lane {lane!r}", details={"lane": lane})
        if max_parallel is not None and max_parallel < 1:
            raise InvalidInput("max_parallel must be at least 1")
        checked: Plan | None = None
        if plan is not None:
            checked = plan if isinstance(plan, Plan) else Plan.model_validate(plan)
            check_plan(checked, self._lanes)
            admit_commands(checked, self.roster.policy.command, self.options.confinement.hidden)
        budget_limits = limits(budget, self.roster.policy.budget)
        run_id = "r" + uuid.uuid4().hex[:15]  # see RUN_ID
        body = {
            "request": request,
            "lane": lane,
            "plan": k.safe(checked.model_dump(mode="json", by_alias=True)) if checked else None,
            "budget": budget_limits.model_dump(),
            "max_parallel": max_parallel,
            "barrier": barrier,
            "idempotency_key": idempotency_key,
            "client": client,
        }
        self._admit()  # no await from here to the witness: the check and the counts agree
        self._appending_requests += 1
        claim: asyncio.Future[str] | None = None
        if idempotency_key is not None:
            claim = asyncio.get_running_loop().create_future()
            self._remember(idempotency_key, claim, time.time())
        try:
            await self._witness(run_id, k.REQUEST, body, None)
        except BaseException as exc:
            if claim is not None and idempotency_key is not None:
                self._keys.pop(idempotency_key, None)
                claim.set_exception(exc)
                claim.exception()  # retrieved: no "never retrieved" warning
            raise
        finally:
            self._appending_requests -= 1
        if claim is not None:
            claim.set_result(run_id)
        self._start(run_id, fresh=checked)
        return self.get(run_id)

    def _admit(self) -> None:
        """Bound the runs in memory: `max_runs` execute, `max_queued_runs` more wait queued."""
        policy = self.roster.policy
        admitted = self.census.active() + self._appending_requests
        if admitted >= policy.max_runs + policy.max_queued_runs:
            raise Busy(
                f"tally is at capacity: {policy.max_runs} runs executing and "
                f"{policy.max_queued_runs} queued; retry later",
                retry_after=5.0,
                details={"max_runs": policy.max_runs, "max_queued_runs": policy.max_queued_runs},
            )

    def _key(self, key: str | None) -> asyncio.Future[str] | None:
        """The run an Idempotency-Key names, unless it is unknown or past its TTL."""
        if key is None or (found := self._keys.get(key)) is None:
            return None
        if time.time() - found[1] > self.options.key_ttl_s:
            del self._keys[key]
            return None
        return found[0]

    def _remember(self, key: str, run: asyncio.Future[str], at: float) -> None:
        self._keys[key] = (run, at)
        self._keys.move_to_end(key)
        while len(self._keys) > self.options.max_keys:
            self._keys.popitem(last=False)

    def queued(self) -> int:
        """Runs admitted and waiting for a run slot (state `queued`)."""
        return self.census.runs["queued"]

    def in_flight(self) -> int:
        """Runs being driven right now (what a stop drains)."""
        return sum(1 for ctx in self._runs.values() if ctx.task is not None and not ctx.task.done())

    async def cancel(self, run_id: str, reason: str = "cancelled by request") -> RunView:
        if run_id not in self._views:  # a summary or nothing: finished long ago
            return await self.find(run_id)
        view = self.get(run_id)
        if view.state in FINAL:
            return view
        ctx = self._runs.get(run_id)
        if ctx is None:  # interrupted: nothing runs, record the decision
            seq = await self._witness(run_id, k.CANCEL, {"reason": reason}, view.request_seq)
            await self._witness(run_id, k.STATE, {"state": "cancelled", "error": reason}, seq)
            self._retire(run_id)
            return self.get(run_id)
        if not ctx.cancelling:
            ctx.cancelling = True  # checked before every task start: none starts after this
            await self._witness(run_id, k.CANCEL, {"reason": reason}, view.request_seq)
            await self._abort(ctx)
        await ctx.finished.wait()
        return self.get(run_id)

    async def resume(self, run_id: str) -> RunView:
        if run_id not in self._views:  # a summary or nothing: finished long ago
            view = await self.find(run_id)
            raise Conflict(f"run {run_id} is {view.state}; only an interrupted run resumes")
        view = self.get(run_id)
        if view.state != "interrupted" or run_id in self._runs:
            raise Conflict(f"run {run_id} is {view.state}; only an interrupted run resumes")
        done = [t.id for t in view.tasks if t.state == "done"]
        redo = [t.id for t in view.tasks if t.state != "done"]
        body = {
            "reused": done,
            "redo": redo,
            "stage": "dispatch" if view.plan_seq is not None else "route",
            "spent": view.spent.model_dump(),
        }
        self._admit()
        await self._witness(run_id, k.RESUME, body, view.answer_seq or view.request_seq)
        self._start(run_id, fresh=None)
        return self.get(run_id)

    async def restore(self, snapshot: Snapshot | None = None) -> builtins.list[str]:
        """Rebuild run state from the ledger; every run found in flight becomes interrupted.

        With a `snapshot` (already checked against the ledger) only the entries after it are
        replayed; a redaction among them makes it replay everything instead.
        """
        views: dict[str, RunView] = {}
        if snapshot is not None:
            base = {v.id: v for v in snapshot.views}  # the caller hands the views over
            try:
                views = await replay(self.ledger, start=snapshot.size, views=base)
            except RedactedAfterSnapshot:
                snapshot = None
        if snapshot is None:
            views = await replay(self.ledger)
        self.restored_from = snapshot.size if snapshot is not None else None
        self._views.update(views)
        self.census = Census.of(self._views.values())
        for view in views.values():
            if view.idempotency_key is not None:
                done: asyncio.Future[str] = asyncio.get_running_loop().create_future()
                done.set_result(view.id)
                self._remember(view.idempotency_key, done, view.started_at_us / 1e6)
        interrupted: builtins.list[str] = []
        for view in list(views.values()):
            if view.state in STOPPED:
                if view.state in FINAL:
                    self._retire(view.id)
                continue
            body = {
                "reason": "the daemon stopped while the run was in flight",
                "previous": view.state,
                "spent_wall_ms": view.spent.wall_ms,
            }
            self._appending += 1
            try:
                entry = await self.ledger.append(
                    actor="daemon",
                    kind=k.INTERRUPTED,
                    body=body,
                    run=view.id,
                    parent=view.request_seq,
                )
                self._apply(entry.seq, entry.ts, k.INTERRUPTED, view.id, body)
            finally:
                self._appending -= 1
            interrupted.append(view.id)
        return interrupted

    def snapshot(self) -> tuple[int, builtins.list[RunView], builtins.list[bytes]] | None:
        """(ledger size, a copy of every full run view, every summary's JSON) at one instant,
        or None while an append is in flight.

        With no run entry between its append and its apply, the views are exactly the
        reduction of the ledger's first `size` entries (only the engine writes run entries).
        Nothing in the list changes afterwards, so it can be encoded off the loop: a finished
        run's view is never changed again (no entry follows its final state, and `_retire`
        replaces a view rather than editing it), and a run still going is copied.
        """
        if self._appending:
            return None
        views = [
            view if view.state in FINAL else view.model_copy(deep=True)
            for view in self._views.values()
        ]
        return self.ledger.size, views, self._summaries.encoded()

    async def shutdown(self, drain_s: float = 5.0) -> None:
        """Let runs finish for `drain_s`, then interrupt the rest (witnessed, resumable)."""
        self._closing = True
        active = [ctx for ctx in self._runs.values() if ctx.task is not None]
        if active and drain_s > 0:
            waiters = [asyncio.create_task(ctx.finished.wait()) for ctx in active]
            await asyncio.wait(waiters, timeout=drain_s)
            for waiter in waiters:
                waiter.cancel()
        for ctx in list(self._runs.values()):
            if ctx.task is not None and not ctx.task.done():
                ctx.interrupting = True
                await self._abort(ctx)
        for ctx in list(self._runs.values()):
            await ctx.finished.wait()

    async def _abort(self, ctx: _Run) -> None:
        # A task cancelled before its first step never runs its handlers: let it start first.
        await ctx.started.wait()
        if ctx.task is not None:
            ctx.task.cancel()

    # ---------------------------------------------------------------- witnessing

    async def _witness(
        self, run_id: str, kind: str, body: dict[str, Any], parent: int | None
    ) -> int:
        self._appending += 1
        try:
            entry = await self.ledger.append(
                actor=k.ACTOR, kind=kind, body=body, run=run_id, parent=parent
            )
            self._apply(entry.seq, entry.ts, kind, run_id, body)
        finally:
            self._appending -= 1
        for watcher in self._watchers:
            try:
                watcher(entry, body)
            except Exception:  # an observer's fault must never fail the run it observes
                log.exception("a run watcher failed on %s", kind)
        listeners = self._listeners.get(run_id)
        if listeners:
            event = RunEvent(seq=entry.seq, kind=kind, data=body)
            for queue in listeners:
                queue.put_nowait(event)
        return int(entry.seq)

    def _apply(self, seq: int, ts: int, kind: str, run_id: str, body: dict[str, Any]) -> None:
        """The reducer on the live views, keeping the census in step with it."""
        before = self._views.get(run_id)
        if before is not None:
            self.census.count(before, -1)
        apply(self._views, seq, ts, kind, run_id, body)
        after = self._views.get(run_id)
        if after is not None:
            self.census.count(after)

    def _delta(self, run_id: str, text: str, task: str | None = None) -> None:
        """A streamed token: `task` names the chat task it belongs to (None: synthesis)."""
        for queue in self._listeners.get(run_id, ()):
            queue.put_nowait(RunEvent(seq=None, kind="delta", data={"text": text, "task": task}))

    def _retire(self, run_id: str) -> None:
        """Bound memory: finished runs past `keep_runs` keep a summary only, and summaries past
        `keep_summaries` more leave memory (find() reads them back from the ledger). The census
        keeps counting them: its totals are of every run the daemon knows."""
        policy = self.roster.policy
        self._finished[run_id] = None
        self._compacted[run_id] = None
        while len(self._compacted) > policy.keep_runs + policy.keep_summaries:
            old, _ = self._compacted.popitem(last=False)
            self._views.pop(old, None)
            self._summaries.drop(old)
            self._finished.pop(old, None)
        while len(self._finished) > policy.keep_runs:
            old, _ = self._finished.popitem(last=False)
            view = self._views.pop(old, None)  # not edited: a snapshot may be encoding it
            if view is not None:
                self._summaries.add(view)

    # ---------------------------------------------------------------- driving a run

    def _start(self, run_id: str, fresh: Plan | None) -> None:
        view = self._views[run_id]
        ctx = _Run(
            id=run_id,
            meter=Meter(view.budget, view.spent),
            client_plan=fresh,
            fresh=view.state == "queued" and view.plan is None,
        )
        for task in view.tasks:
            if task.state == "done" and task.result is not None:
                ctx.outputs[task.id] = task.result
        self._runs[run_id] = ctx
        ctx.task = asyncio.create_task(self._drive(ctx), name=f"run {run_id}")

    async def _drive(self, ctx: _Run) -> None:
        ctx.started.set()
        view = self._views[ctx.id]
        try:
            elapsed_ms = view.wall_base_ms + (time.time_ns() // 1000 - view.started_at_us) // 1000
            wall = asyncio.timeout(ctx.meter.wall_s(elapsed_ms))
            try:
                async with wall, self._run_gate:
                    if ctx.cancelling:
                        raise asyncio.CancelledError
                    await self._work(ctx)
            except TimeoutError:
                if not wall.expired():
                    raise
                raise BudgetExhausted("wall") from None
        except BudgetExhausted as exc:
            spent = view.spent.model_dump()
            now_us = time.time_ns() // 1000
            spent["wall_ms"] = max(
                view.spent.wall_ms, view.wall_base_ms + (now_us - view.started_at_us) // 1000
            )
            seq = await self._witness(
                ctx.id,
                k.BUDGET,
                {"limit": exc.limit, "budget": view.budget.model_dump(), "spent": spent},
                view.request_seq,
            )
            await self._final(ctx, "budget_exhausted", f"budget exhausted: {exc.limit}", seq)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()
            if ctx.interrupting and not ctx.cancelling:
                now_us = time.time_ns() // 1000
                wall_ms = view.wall_base_ms + (now_us - view.started_at_us) // 1000
                body = {
                    "reason": "the daemon stopped",
                    "previous": view.state,
                    "spent_wall_ms": max(view.spent.wall_ms, wall_ms),
                }
                await self._witness(ctx.id, k.INTERRUPTED, body, view.request_seq)
            else:
                await self._final(ctx, "cancelled", "cancelled by request", None)
        except Exception as exc:
            await self._final(ctx, "failed", _describe(exc), None)
        finally:
            self._runs.pop(ctx.id, None)
            ctx.finished.set()
            if view.state in FINAL:
                self._retire(ctx.id)

    async def _final(self, ctx: _Run, state: str, error: str | None, parent: int | None) -> None:
        view = self._views[ctx.id]
        await self._witness(
            ctx.id, k.STATE, {"state": state, "error": error}, parent or view.request_seq
        )

    async def _work(self, ctx: _Run) -> None:
        view = self._views[ctx.id]
        if view.plan is None:
            if not ctx.fresh:  # resumed before planning: the client's plan is in the request
                body = await self._request_body(view)
                if body.get("plan") is not None:
                    ctx.client_plan = Plan.model_validate(k.unsafe(body["plan"]))
            lane, parent = await self._route(ctx)
            await self._plan(ctx, lane, parent)
        assert view.plan is not None
        assert view.plan_seq is not None
        plan = Plan.model_validate(k.unsafe(view.plan))
        by_id = {t.id: t for t in plan.tasks}
        nodes = [Node(t.id, t.lane, tuple(t.needs)) for t in plan.tasks]
        policy = self.roster.policy

        async def execute(task_id: str) -> bool:
            return await self._execute(ctx, plan, by_id[task_id])

        async def skip(task_id: str, reason: str) -> None:
            await self._witness(
                ctx.id, k.TASK_SKIP, {"task": task_id, "reason": reason}, view.plan_seq
            )

        outcome = await dispatch(
            nodes,
            execute,
            max_parallel=view.max_parallel or policy.max_parallel,
            capacity=self.capacity,
            barrier=view.barrier,
            done=set(ctx.outputs),
            stop_on_failure=policy.on_task_failure == "fail",
            on_skip=skip,
        )
        if outcome.failed and (policy.on_task_failure == "fail" or not outcome.done):
            failed = sorted(outcome.failed)
            errors = [f"{t}: {(view.task(t) or view.tasks[0]).error}" for t in failed]
            raise TaskFailed("task failed: " + "; ".join(errors))
        answer_seq = await self._synthesize(ctx, plan)
        answer = view.answer or ""
        await self._witness(ctx.id, k.INTENT, checks.intent(view.request, answer), answer_seq)
        await self._final(ctx, "done", None, answer_seq)

    # ---------------------------------------------------------------- route and plan

    async def _route(self, ctx: _Run) -> tuple[str, int]:
        view = self._views[ctx.id]
        if view.lane is not None:
            body = {
                "lane": view.lane,
                "confidence_ppm": 1_000_000,
                "escalate": False,
                "source": "client",
                "scores": [],
                "matched": {},
            }
            return view.lane, await self._witness(ctx.id, k.ROUTE, body, view.request_seq)
        route = self.router.route(view.request)
        scores = [[lane, _ppm(score)] for lane, score in list(route.scores)[:8]]
        body = {
            "lane": route.lane,
            "confidence_ppm": _ppm(route.confidence),
            "escalate": bool(route.escalate),
            "source": "router",
            "scores": scores,
            "matched": {lane: list(words) for lane, words in dict(route.matched).items()},
        }
        seq = await self._witness(ctx.id, k.ROUTE, body, view.request_seq)
        if route.lane is not None and not route.escalate:
            return str(route.lane), seq
        if ctx.client_plan is not None:  # the client planned: its lanes decide, no model call
            return str(route.lane or ctx.client_plan.tasks[0].lane), seq
        ranked = [lane for lane, score in route.scores if score > 0 and lane in self._lanes]
        candidates = ranked[:CANDIDATES]
        if GENERAL in self._lanes and GENERAL not in candidates:
            candidates.append(GENERAL)  # the classifier may say that no lane fits
        classifier = self._classifier
        if classifier is None or not ranked:
            # No model call: the best-scoring lane, or `general` when no lane's words match.
            lane = ranked[0] if ranked else (GENERAL if GENERAL in self._lanes else None)
            lane = lane or (route.lane if route.lane in self._lanes else self.roster.lanes[0].name)
            source = "scores" if ranked else "general"
            body = {"lane": lane, "candidates": candidates, "source": source, "error": None}
            return lane, await self._witness(ctx.id, k.CLASSIFY, body, seq)
        return await self._classify(ctx, classifier, candidates, seq)

    async def _classify(
        self, ctx: _Run, classifier: str, candidates: builtins.list[str], parent: int
    ) -> tuple[str, int]:
        """The classifier model picks one of the few best-scoring lanes (or `general`)."""
        view = self._views[ctx.id]
        fallback = candidates[0]
        schema = {
            "type": "object",
            "properties": {"lane": {"type": "string", "enum": candidates}},
            "required": ["lane"],
            "additionalProperties": False,
        }
        described = "\n".join(
            f"- {name}: {self._lanes[name].system.splitlines()[0][:160]}" for name in candidates
        )
        messages = [
            {
                "role": "system",
                "content": "You route a request to the one lane best suited to it. "
                'Reply with only JSON: {"lane": "<name>"}.',
            },
            {"role": "user", "content": f"Lanes:\n{described}\n\nRequest:\n{view.request}"},
        ]

        def valid(value: Any) -> str:
            lane = value.get("lane") if isinstance(value, dict) else None
            if lane not in candidates:
                raise ValueError(f"lane must be one of {', '.join(candidates)}")
            return str(lane)

        lane, source, error, reply_seq = fallback, "fallback", None, None
        try:
            got = await self._structured(
                ctx, "classify", classifier, messages, schema, valid, parent
            )
            lane, source, reply_seq = got.value, "model", got.reply_seq
        except (BudgetExhausted, asyncio.CancelledError):
            raise
        except Exception as exc:  # the classifier is advice: fall back to the best score
            error = _describe(exc)
        body = {"lane": lane, "candidates": candidates, "source": source, "error": error}
        return lane, await self._witness(ctx.id, k.CLASSIFY, body, reply_seq or parent)

    async def _plan(self, ctx: _Run, lane: str, parent: int) -> int:
        view = self._views[ctx.id]
        source, error = "single", None
        plan: Plan | None = None
        if ctx.client_plan is not None:
            plan = ctx.client_plan
            source = "client"
        elif self._coordinator is not None:
            try:
                plan, parent = await self._coordinate(ctx, lane, parent)
                source = "coordinator"
            except (BudgetExhausted, asyncio.CancelledError):
                raise
            except Exception as exc:
                source, error = "fallback", _describe(exc)
        if plan is None:
            plan = Plan(tasks=[Task(id="t1", lane=lane, instruction=view.request)])
        nodes = [Node(t.id, t.lane, tuple(t.needs)) for t in plan.tasks]
        waves = levels(nodes, view.max_parallel or self.roster.policy.max_parallel)
        body = {
            "source": source,
            "plan": k.safe(plan.model_dump(mode="json", by_alias=True)),
            "waves": waves,
            "critical_path": _depth(nodes),
            "error": error,
        }
        return await self._witness(ctx.id, k.PLAN, body, parent)

    async def _request_body(self, view: RunView) -> dict[str, Any]:
        entry = await self.ledger.entries(start=view.request_seq, limit=1, run=view.id)
        body = (await self.ledger.body(entry[0].body)).value if entry else None
        return body if isinstance(body, dict) else {}

    async def _coordinate(self, ctx: _Run, lane: str, parent: int) -> tuple[Plan, int]:
        view = self._views[ctx.id]
        names = list(self._lanes)
        schema = {
            "type": "object",
            "properties": {
                "tasks": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 12,
                    "items": {
                        "type": "object",
                        "properties": {
                            "id": {"type": "string"},
                            "lane": {"type": "string", "enum": names},
                            "instruction": {"type": "string"},
                            "needs": {"type": "array", "items": {"type": "string"}},
                        },
                        "required": ["id", "lane", "instruction", "needs"],
                        "additionalProperties": False,
                    },
                }
            },
            "required": ["tasks"],
            "additionalProperties": False,
        }
        messages = [
            {
                "role": "system",
                "content": "You split a request into a few tasks for specialist lanes. Each task "
                "has an id, a lane, an instruction and the ids of the tasks it needs. Reply with "
                'only JSON: {"tasks": [{"id": "t1", "lane": "...", "instruction": "...", '
                '"needs": []}]}. Lanes: ' + ", ".join(names) + ".",
            },
            {"role": "user", "content": f"Suggested lane: {lane}\n\nRequest:\n{view.request}"},
        ]

        def valid(value: Any) -> Plan:
            if not isinstance(value, dict):
                raise ValueError("the plan must be a JSON object with 'tasks'")
            tasks = value.get("tasks")
            if not isinstance(tasks, list):
                raise ValueError("the plan must have a 'tasks' list")
            # A model may only plan chat tasks: commands are for clients that declare them.
            plan = Plan.model_validate(
                {
                    "tasks": [
                        {
                            "id": t.get("id"),
                            "lane": t.get("lane"),
                            "instruction": t.get("instruction"),
                            "needs": t.get("needs", []),
                        }
                        for t in tasks
                        if isinstance(t, dict)
                    ]
                }
            )
            check_plan(plan, self._lanes)
            return plan

        got = await self._structured(
            ctx, "plan", self._coordinator or "", messages, schema, valid, parent
        )
        return got.value, got.reply_seq or parent

    # ---------------------------------------------------------------- model calls

    async def _structured(
        self,
        ctx: _Run,
        purpose: str,
        target: str,
        messages: builtins.list[dict[str, Any]],
        schema: dict[str, Any],
        validate: Any,
        parent: int,
    ) -> guard.Guarded[Any]:
        last_parent = parent

        async def ask(
            history: builtins.list[dict[str, Any]], attempt: int
        ) -> tuple[str, int | None]:
            nonlocal last_parent
            result, seq = await self._call(
                ctx,
                purpose=purpose,
                target=target,
                messages=history,
                parent=last_parent,
                response_format=guard.response_format(purpose, schema),
                priority=0,
            )
            return str(result.text), seq

        async def witness(attempt: guard.Attempt) -> None:
            nonlocal last_parent
            body = {
                "purpose": attempt.purpose,
                "attempt": attempt.attempt,
                "outcome": attempt.outcome,
                "error": attempt.error,
            }
            last_parent = await self._witness(
                ctx.id, k.GUARD, body, attempt.reply_seq or last_parent
            )

        return await guard.structured(
            purpose,
            messages,
            ask,
            validate,
            attempts=self.options.guard_attempts,
            on_attempt=witness,
        )

    async def _call(
        self,
        ctx: _Run,
        *,
        purpose: str,
        target: str,
        messages: builtins.list[dict[str, Any]],
        parent: int,
        task: str | None = None,
        affinity: str | None = None,
        response_format: dict[str, Any] | None = None,
        stream: bool = False,
        priority: int = 1,
        max_tokens: int | None = None,
    ) -> tuple[ChatReply, int]:
        """One witnessed, metered model call through a slot lease."""
        ctx.meter.reserve_call()
        max_tokens = min(max_tokens or self.options.max_tokens, self.options.max_tokens)
        on_delta = (lambda text: self._delta(ctx.id, text, task)) if stream else None
        async with self.pool.lease(target, priority=priority, affinity=affinity) as lease:
            request = k.safe(lease.request(messages, max_tokens, response_format, stream=stream))
            call_body = {
                "purpose": purpose,
                "task": task,
                "target": target,
                "member": lease.member,
                "instance": lease.instance,
                "slot": lease.id_slot,
                "request": request,
            }
            call_seq = await self._witness(ctx.id, k.MODEL_CALL, call_body, parent)
            try:
                result = await lease.chat(
                    messages,
                    max_tokens=max_tokens,
                    response_format=response_format,
                    on_delta=on_delta,
                )
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                where = {"member": lease.member, "instance": lease.instance, "slot": lease.id_slot}
                await self._witness(
                    ctx.id,
                    k.MODEL_REPLY,
                    {"text": "", "finish_reason": None, "usage": None, "timings": {}}
                    | where
                    | {"error": _describe(exc)},
                    call_seq,
                )
                raise
            # Read after the call: a tier's lease that moved a failed call names where it ran.
            where = {"member": lease.member, "instance": lease.instance, "slot": lease.id_slot}
            usage = result.usage
            # What went upstream, when the lease reports it (a relay adds the slot's fields).
            sent = k.safe(dict(getattr(result, "request", None) or {}))
            reply = {
                "text": result.text,
                "finish_reason": result.finish_reason,
                "usage": {
                    "prompt_tokens": usage.prompt_tokens,
                    "completion_tokens": usage.completion_tokens,
                    "cached_tokens": usage.cached_tokens,
                },
                "timings": ledger_timings(result.timings),
                "sent": _differs(request, sent),
                "error": None,
            } | where
            remote = getattr(result, "remote", None)
            if remote is not None:  # another tally daemon served it: where its record has it
                reply["remote"] = {"member": lease.member, **remote}
            reply_seq = await self._witness(ctx.id, k.MODEL_REPLY, reply, call_seq)
        ctx.meter.check_tokens()
        return result, reply_seq

    # ---------------------------------------------------------------- tasks

    async def _execute(self, ctx: _Run, plan: Plan, task: Task) -> bool:
        """Run a task up the escalation ladder until a verdict passes or no rung is left."""
        view = self._views[ctx.id]
        lane = self._lanes.get(task.lane)
        if lane is None:
            raise TaskFailed(f"task {task.id}: no lane {task.lane!r} in the roster")
        ladder = self.roster.tiers.ladder
        rung = ladder.index(lane.tier) if lane.tier in ladder else 0
        needs_seqs = [
            t.verdict_seq for n in task.needs if (t := view.task(n)) and t.verdict_seq is not None
        ]
        parent = max(needs_seqs) if needs_seqs else view.plan_seq or view.request_seq
        state = view.task(task.id)
        attempt = state.attempts if state is not None else 0
        feedback: builtins.list[str] = []
        previous: str | None = None
        while True:
            if ctx.cancelling:
                raise asyncio.CancelledError
            attempt += 1
            tier = ladder[rung] if task.executor != "command" else None
            output, exit_code, error, result_seq = await self._attempt(
                ctx, task, lane, tier, attempt, feedback, previous, parent
            )
            failures, judged = await self._assess(ctx, task, output, exit_code, error, result_seq)
            can_climb = task.executor != "command" and rung + 1 < len(ladder)
            nxt = "done" if not failures else ("escalate" if can_climb else "failed")
            verdict_seq = await self._witness(
                ctx.id,
                k.TASK_VERDICT,
                {
                    "task": task.id,
                    "attempt": attempt,
                    "ok": not failures,
                    "failures": failures,
                    "judge": judged,
                    "next": nxt,
                },
                result_seq,
            )
            if nxt == "done":
                ctx.outputs[task.id] = output
                return True
            if nxt == "failed":
                return False
            parent = await self._witness(
                ctx.id,
                k.TASK_ESCALATE,
                {
                    "task": task.id,
                    "from_tier": tier,
                    "to_tier": ladder[rung + 1],
                    "reason": failures[0],
                    "failures": failures,
                },
                verdict_seq,
            )
            rung += 1
            feedback, previous = failures, output

    async def _attempt(
        self,
        ctx: _Run,
        task: Task,
        lane: Lane,
        tier: str | None,
        attempt: int,
        feedback: builtins.list[str],
        previous: str | None,
        parent: int,
    ) -> tuple[str, int | None, str | None, int]:
        """One try on one rung, witnessed start and result: (output, exit code, error, seq)."""
        start_seq = await self._witness(
            ctx.id,
            k.TASK_START,
            {
                "task": task.id,
                "lane": task.lane,
                "executor": task.executor,
                "tier": tier,
                "attempt": attempt,
                "needs": list(task.needs),
                "feedback": feedback,
            },
            parent,
        )
        upstream = {n: ctx.outputs.get(n, "") for n in task.needs}
        output, exit_code, error = "", None, None
        result_parent = start_seq
        try:
            output, exit_code, result_parent = await self._run_executor(
                ctx, task, lane, tier, attempt, upstream, feedback, previous, start_seq
            )
        except (BudgetExhausted, asyncio.CancelledError):
            raise
        except Exception as exc:  # an executor error is a failed attempt, not a crash
            error = _describe(exc)
        output = clip(output, RESULT_CAP)
        result_seq = await self._witness(
            ctx.id,
            k.TASK_RESULT,
            {
                "task": task.id,
                "attempt": attempt,
                "ok": error is None,
                "output": output,
                "exit_code": exit_code,
                "error": error,
            },
            result_parent,
        )
        return output, exit_code, error, result_seq

    async def _assess(
        self,
        ctx: _Run,
        task: Task,
        output: str,
        exit_code: int | None,
        error: str | None,
        result_seq: int,
    ) -> tuple[builtins.list[str], dict[str, Any] | None]:
        """Why the attempt fails (empty: it passes), and the judge's verdict if one was asked."""
        if error is not None:
            return [f"the executor failed: {error}"], None
        failures = checks.check(task.assertions, output, exit_code)
        # The judge costs a model call, so only output that already passes its assertions gets one.
        if failures or not self._judge_target or task.executor != "chat":
            return failures, None
        judged = await self._judge(ctx, task, output, result_seq)
        if not judged["ok"]:
            failures.append(f"the judge found: {judged['reason']}")
        return failures, judged

    async def _run_executor(
        self,
        ctx: _Run,
        task: Task,
        lane: Lane,
        tier: str | None,
        attempt: int,
        upstream: Mapping[str, str],
        feedback: builtins.list[str],
        previous: str | None,
        start_seq: int,
    ) -> tuple[str, int | None, int]:
        if task.executor == "command":
            if not task.argv:
                raise InvalidInput(f"task {task.id}: a command task needs argv")
            policy = self.roster.policy.command
            admit_commands(
                Plan(tasks=[task]), policy, self.options.confinement.hidden
            )  # the roster may have changed since
            outcome = await run_command(
                task.argv,
                policy=policy,
                confinement=self.options.confinement,
                network=task.network,
                timeout_s=min(
                    task.timeout_s or self.options.command_timeout_s, policy.max_timeout_s
                ),
            )
            seq = await self._witness(ctx.id, k.COMMAND_RUN, outcome.body(task.id), start_seq)
            if outcome.timed_out:
                raise TimeoutError(f"the command timed out after {outcome.duration_ms} ms")
            return outcome.stdout, outcome.exit_code, seq
        if task.executor == "stub":
            return await self.stub(task.id, task.instruction, attempt, upstream), None, start_seq
        messages = chat_messages(lane.system, task.instruction, upstream, feedback, previous)
        result, reply_seq = await self._call(
            ctx,
            purpose="task",
            task=task.id,
            target=tier or lane.tier,
            messages=messages,
            parent=start_seq,
            affinity=lane.name,
            response_format=_constrained(task),
            stream=True,  # every chat task's tokens reach SSE (and MCP progress) as they come
        )
        return str(result.text), None, reply_seq

    async def _judge(self, ctx: _Run, task: Task, output: str, parent: int) -> dict[str, Any]:
        schema = {
            "type": "object",
            "properties": {"ok": {"type": "boolean"}, "reason": {"type": "string"}},
            "required": ["ok", "reason"],
            "additionalProperties": False,
        }
        messages = [
            {
                "role": "system",
                "content": "You check whether an answer does what its instruction asked. Reply "
                'with only JSON: {"ok": true|false, "reason": "<one sentence>"}.',
            },
            {
                "role": "user",
                "content": f"Instruction:\n{task.instruction}\n\nAnswer:\n{clip(output, 6000)}",
            },
        ]

        def valid(value: Any) -> dict[str, Any]:
            if not isinstance(value, dict) or not isinstance(value.get("ok"), bool):
                raise ValueError('the verdict must be {"ok": bool, "reason": str}')
            return {"ok": value["ok"], "reason": str(value.get("reason", ""))[:500]}

        try:
            got = await self._structured(
                ctx, "judge", self._judge_target or "", messages, schema, valid, parent
            )
        except (BudgetExhausted, asyncio.CancelledError):
            raise
        except Exception as exc:  # an unavailable judge does not fail a task
            return {"ok": True, "reason": f"no judgement: {_describe(exc)}"}
        value: dict[str, Any] = got.value
        return value

    # ---------------------------------------------------------------- answer

    async def _synthesize(self, ctx: _Run, plan: Plan) -> int:
        view = self._views[ctx.id]
        done = [t for t in view.tasks if t.state == "done"]
        last = max((t.verdict_seq or 0 for t in done), default=view.plan_seq or 0)
        if len(plan.tasks) == 1 and done:
            body = {"answer": ctx.outputs.get(done[0].id, ""), "source": "single"}
            return await self._witness(ctx.id, k.ANSWER, body, done[0].verdict_seq or last)
        results = {t.id: ctx.outputs.get(t.id, "") for t in done}
        lane = self._lanes.get(view.lane or "") or self.roster.lanes[0]
        messages = [
            {
                "role": "system",
                "content": "Combine the task results below into a short answer to the request: "
                "a few sentences that answer it and say which task's result holds the "
                "details. The results follow your answer in full: do not repeat them.",
            },
            {
                "role": "user",
                "content": f"Request:\n{view.request}\n\n{upstream_block(results)}",
            },
        ]
        try:
            result, reply_seq = await self._call(
                ctx,
                purpose="synthesize",
                target=lane.tier,
                messages=messages,
                parent=last,
                affinity=lane.name,
                stream=True,
                priority=0,
                max_tokens=SYNTHESIS_TOKENS,
            )
        except (BudgetExhausted, asyncio.CancelledError):
            raise
        except Exception as exc:  # the task results still answer the request
            answer = _with_results("", done, results)
            failed = {"answer": answer, "source": "results", "error": _describe(exc)}
            return await self._witness(ctx.id, k.ANSWER, failed, last)
        summary, looped = await asyncio.to_thread(cut_loop, str(result.text))
        answered: dict[str, Any] = {
            "answer": _with_results(summary, done, results),
            "source": "synthesis",
            "looped": looped,
        }
        return await self._witness(ctx.id, k.ANSWER, answered, reply_seq)


GENERAL = "general"
"""The fallback lane: a request no lane's words match goes here, with no model call."""
CANDIDATES = 4
"""Lanes a classifier chooses among: the best-scoring few, not every lane."""

SYNTHESIS_TOKENS = 320
"""The synthesis is a short summary above the task results, not a rewrite of them."""


def _with_results(summary: str, done: list[Any], results: Mapping[str, str]) -> str:
    """The answer: the summary, then every task's result verbatim under its id and lane."""
    parts = [summary.strip()] if summary.strip() else []
    for task in done:
        parts.append(f"## {task.id} ({task.lane})\n\n{results.get(task.id, '').strip()}")
    return "\n\n".join(parts)


def _ends(event: RunEvent) -> bool:
    if event.kind == k.STATE:
        return True
    return event.kind == k.INTERRUPTED


def _ppm(value: Any) -> int:
    return round(float(value) * 1_000_000)


def _depth(nodes: list[Node]) -> int:
    by_id = {n.id: n for n in nodes}
    memo: dict[str, int] = {}

    def depth(node_id: str, seen: frozenset[str] = frozenset()) -> int:
        if node_id in memo:
            return memo[node_id]
        if node_id in seen or node_id not in by_id:
            return 0
        needs = [depth(n, seen | {node_id}) for n in by_id[node_id].needs]
        memo[node_id] = 1 + max(needs, default=0)
        return memo[node_id]

    return max((depth(n.id) for n in nodes), default=0)


def _constrained(task: Task) -> dict[str, Any] | None:
    """A task whose output must match a JSON schema asks the server for exactly that
    (constrained decoding); the assertion still checks it, and a failure still escalates."""
    for assertion in task.assertions:
        if assertion.type == "json_schema":
            return guard.response_format("task_output", assertion.json_schema)
    return None


def _differs(witnessed: object, sent: object) -> object:
    """None when the pool sent what model.call witnessed (or did not say what it sent), else
    the body it did send minus its messages, so the ledger never hides a parameter."""
    if not isinstance(sent, dict) or not sent or not isinstance(witnessed, dict):
        return None
    if sent == witnessed:
        return None
    return {key: value for key, value in sent.items() if key != "messages"}


def _describe(exc: BaseException) -> str:
    message = getattr(exc, "message", None) or str(exc) or type(exc).__name__
    text = f"{type(exc).__name__}: {message}"
    return text if len(text) <= 500 else text[:499] + "…"
