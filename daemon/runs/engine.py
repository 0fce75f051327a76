"""The runs engine: the run table and the coordinator of a run's steps.

One piece (past 500 lines) because every control below writes run entries through the one
witnessing path, under the invariant that the live views are the reduction of the ledger.

submit → route → plan → waves → synthesis → answer. Each step is its own module (`routing`,
`planning`, `tasks` with `attempts`, `synthesis`, around them `lifecycle`; model calls in
`calls`), a function of the engine's `Setting` and the `Run` (see `context`); none imports
this module. The engine owns what outlives one step: the run table (`table`: views, summaries,
census), the runs being driven, idempotency keys (`keys`) and the live feed (`feed`), and it
is the only writer of run entries: `_witness` appends an entry (with a causal parent, see
`entries`), applies it to the live view with the replay reducer, so what a client reads and
what replay rebuilds are the same thing, then publishes it. Entries whose parents are durable
already (a done run's intent and state; restore's interrupted entries) are appended at once,
so they share a group commit: one fsync wait instead of one each.

A caller that stops waiting does not stop what its append starts. The ledger commits an entry
whose wait was cancelled (nothing acknowledged is undone), so the apply and the publish are the
ledger's `on_commit`, run as the entry commits rather than when the caller resumes; and the
step a control entry belongs to (starting the run it requests, aborting the run it cancels,
resuming) runs in a shielded task (`_step`). Else the views would lack what the record
holds, and the next snapshot would stamp that divergence for every later start. `shutdown`
waits for the steps in flight before it looks at the runs: a submit's step may start one.

Control: `submit` witnesses `run.request` and starts driving; `cancel` witnesses `run.cancel`
(no task starts after it) and aborts; `resume` witnesses `run.resume` for an interrupted run;
`restore` rebuilds the table from the ledger on start and witnesses every run found in flight
as `run.interrupted` (actor "daemon"); `shutdown` drains, then interrupts. Idempotency keys
live `key_ttl_s` (24 h) and at most `max_keys` of them are kept.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import functools
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

from daemon import record as rec
from daemon.errors import Busy, Conflict, InvalidInput, NotFound
from daemon.plans import Plan, agent_needs_view, check_plan
from daemon.runs import checks, lifecycle, planning, reuse, routing, synthesis, tasks
from daemon.runs import entries as k
from daemon.runs import views as spaces
from daemon.runs.budget import Meter, limits
from daemon.runs.changes import RunChanges
from daemon.runs.context import EngineOptions, Run, Setting, TaskFailed, describe
from daemon.runs.dispatch import Capacity
from daemon.runs.executors import Stub
from daemon.runs.feed import OVERRUN, Feed, Watcher, live_data
from daemon.runs.keys import Keys
from daemon.runs.ports import EntryLike, LedgerPort, PoolPort, RouterPort
from daemon.runs.sandbox import admit_commands
from daemon.runs.snapshot import Snapshot
from daemon.runs.state import FINAL, STOPPED, Census, Limits, RunEvent, RunView
from daemon.runs.table import RunTable
from daemon.runs.waits import Waits
from daemon.workspace import patch as workspace_patch
from daemon.workspace.record import ApplyBody, PatchBody, SnapshotBody
from daemon.workspace.view import RunDirs
from roster.models import Budget, Roster

__all__ = ["Engine", "EngineOptions", "Watcher"]

T = TypeVar("T")


class Engine:
    def __init__(
        self,
        ledger: LedgerPort,
        pool: PoolPort,
        roster: Roster,
        router: RouterPort,
        *,
        options: EngineOptions | None = None,
        stub: Stub | None = None,
    ) -> None:
        self.ledger = ledger
        self.options = options or EngineOptions()
        self.table = RunTable()
        self.feed = Feed()
        self.changes = RunChanges(self.feed)  # which runs changed: the run feed reads it
        self.waits = Waits(self.feed.waiting)
        self.setting = Setting(
            ledger=ledger,
            pool=pool,
            router=router,
            options=self.options,
            stub=stub,
            roster=roster,
            views=self.table.views,
            witness=self._witness,
            delta=self.feed.delta,
            waits=self.waits,
        )
        self._runs: dict[str, Run] = {}
        self._keys = Keys(self.options.key_ttl_s, self.options.max_keys)
        self._closing = False
        self._steps: set[asyncio.Task[Any]] = set()
        """Control steps in flight (`_step`): shutdown lets them end before it stops runs."""
        self._requesting: set[str] = set()
        """Runs admitted whose request entry is not applied yet (not in the census)."""
        self._spaces: dict[str, RunDirs] = {}
        """Workspace snapshots taken at submit, until their run starts (`Run.space`)."""
        self.restored_from: int | None = None
        """The ledger size of the snapshot the last restore() continued from (None: full)."""

    # ---------------------------------------------------------------- configuration

    @property
    def roster(self) -> Roster:
        return self.setting.roster

    @roster.setter
    def roster(self, roster: Roster) -> None:
        """The roster alone (its lanes, caps and gate stay): `set_roster` is the whole change."""
        self.setting.roster = roster

    @property
    def router(self) -> RouterPort:
        return self.setting.router

    @router.setter
    def router(self, router: RouterPort) -> None:
        self.setting.router = router

    @property
    def capacity(self) -> Capacity:
        return self.setting.capacity

    @property
    def census(self) -> Census:
        return self.table.census

    def set_roster(self, roster: Roster) -> None:
        """Use a new roster for runs that start from now on."""
        self.setting.use(roster)

    # ---------------------------------------------------------------- reading

    def get(self, run_id: str) -> RunView:
        """The run as memory holds it: in full, or its summary (see `find`)."""
        return self.table.get(run_id)

    def list(self, state: str | None = None, limit: int = 50) -> builtins.list[RunView]:
        """The newest `limit` runs in memory (with this state), newest first."""
        return self.table.newest(state, limit)

    async def find(self, run_id: str) -> RunView:
        """The run in full, from memory or read back from the ledger."""
        return await self.table.find(self.ledger, run_id)

    async def wait(self, run_id: str, timeout: float | None = None) -> RunView:
        if run_id not in self.table.views:
            return await self.find(run_id)
        run = self._runs.get(run_id)
        if run is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await run.finished.wait()
        return self.get(run_id)

    async def events(self, run_id: str, after: int | None = None) -> AsyncIterator[RunEvent]:
        """The run's ledger entries after `after` (plus answer `delta`s), to its stop state."""
        view = await self.find(run_id)
        with self.feed.listen(run_id) as queue:
            # What calls streaming now wrote before this listener came: taken as it registers
            # (no await between), so the queue holds exactly what follows it; it goes out
            # between the entries published before (seq < mark) and those after.
            writing = self.feed.writing(run_id)
            mark = self.ledger.size
            last = -1 if after is None else after
            start = view.request_seq if after is None else after + 1
            while True:
                batch = await self.ledger.entries(start=start, limit=500, run=run_id)
                bodies = await self.ledger.read_bodies([entry.body for entry in batch])
                for entry, (_, body) in zip(batch, bodies, strict=True):
                    if writing and entry.seq >= mark:
                        for event in writing:
                            yield event
                        writing = []
                    last = entry.seq
                    yield RunEvent(seq=entry.seq, kind=entry.kind, data=live_data(entry.kind, body))
                if len(batch) < 500:
                    break
                start = batch[-1].seq + 1
            for event in writing:
                yield event
            live = self.table.views.get(run_id)
            if (live is None or live.state in STOPPED) and run_id not in self._runs:
                return
            for task in sorted(self.waits.of(run_id), key=str):  # waiting already: say so
                yield RunEvent(seq=None, kind="waiting", data={"task": task, "waiting": True})
            while True:
                event = await queue.get()
                if event.kind == OVERRUN:  # this reader fell too far behind: it resumes
                    yield event
                    return
                if event.seq is not None:
                    if event.seq <= last:
                        continue
                    last = event.seq
                yield event
                if event.kind in (k.STATE, k.INTERRUPTED):
                    driven = self._runs.get(run_id)
                    if driven is not None:  # its last entry: the drive ends right after it
                        await driven.finished.wait()
                    if run_id not in self._runs:  # else resumed meanwhile: go on
                        return

    def shown(self, view: RunView) -> RunView:
        """The view as a person reads it now: with the live `queued`/`waiting` of runs and tasks
        waiting for a slot laid over it (a copy; see `daemon.runs.waits`)."""
        return self.waits.shown(view)

    def shown_list(self, state: str | None = None, limit: int = 50) -> builtins.list[RunView]:
        """`list` as `shown` reads the runs: a filter on `queued` or `running` goes by the
        shown state (a run whose work waits for a slot is `queued`, not `running`)."""
        if state not in ("queued", "running"):
            return [self.shown(v) for v in self.list(state, limit)]
        waiting = self.waits.runs()
        views = {v.id: v for v in self.list(state, limit + len(waiting))}
        if state == "queued":
            views |= {r: self.table.views[r] for r in waiting if r in self.table.views}
        shown = [s for s in map(self.shown, views.values()) if s.state == state]
        shown.sort(key=lambda v: (v.created_at_us, v.id), reverse=True)
        return shown[:limit]

    def shown_census(self) -> tuple[dict[str, int], dict[str, int]]:
        """Runs and tasks in memory by state as `shown` reads them (the census, with the runs
        that wait for a slot moved to `queued` and their tasks to `waiting`)."""
        runs, tasks = Counter(self.census.runs), Counter(self.census.tasks)
        for run_id in self.waits.runs():
            view = self.table.views.get(run_id)
            shown = view if view is None else self.shown(view)
            if view is None or shown is None or shown is view:
                continue
            runs[view.state] -= 1
            runs[shown.state] += 1
            for before, after in zip(view.tasks, shown.tasks, strict=True):
                tasks[before.state] -= 1
                tasks[after.state] += 1
        return (
            {state: n for state, n in runs.items() if n > 0},
            {state: n for state, n in tasks.items() if n > 0},
        )

    def watch(self, watcher: Watcher) -> Callable[[], None]:
        """Call `watcher(entry, body)` after every entry the engine witnesses
        (metrics, traces, the console's run feed); returns the function that stops it."""
        return self.feed.watch(watcher)

    def queued(self) -> int:
        """Runs admitted and waiting for a run slot (state `queued`)."""
        return self.census.runs["queued"]

    def in_flight(self) -> int:
        """Runs being driven right now (what a stop drains)."""
        return sum(1 for run in self._runs.values() if run.task is not None and not run.task.done())

    # ---------------------------------------------------------------- workspace patches

    async def patch(self, run_id: str) -> tuple[RunView, PatchBody | None]:
        """The run and its combined patch as witnessed (None: it has none yet)."""
        view = await self.find(run_id)
        if view.patch_seq is None:
            return view, None
        found = await self.ledger.entries(start=view.patch_seq, limit=1)
        if not found or found[0].seq != view.patch_seq:
            raise NotFound(f"run {run_id}: its patch entry {view.patch_seq} is not in the ledger")
        body = await self.ledger.body(found[0].body)
        if body.state != "present":
            raise Conflict(
                f"run {run_id}: its patch (seq {view.patch_seq}) is {body.state}",
                details={"seq": view.patch_seq, "state": body.state},
            )
        return view, PatchBody.model_validate(body.value)

    async def apply(self, run_id: str, check: bool = False, client: str = "owner") -> ApplyBody:
        """Apply the run's patch to its workspace (`check`: only try). Witnessed as
        `workspace.apply` (parent: the patch) unless `check`; a refusal is a Conflict."""
        view, body = await self.patch(run_id)
        if view.workspace is None:
            raise Conflict(f"run {run_id} has no workspace: there is nothing to apply it to")
        if body is None or view.patch_seq is None:
            raise Conflict(
                f"run {run_id} is {view.state} and has no patch (a run has one once its tasks "
                "are done)"
            )
        if body.error is not None:
            raise Conflict(f"run {run_id}: its patch was not made: {body.error}")
        where = Path(view.workspace)
        try:
            applied = await asyncio.to_thread(workspace_patch.apply, where, body, check)
        except workspace_patch.ApplyRefused as exc:
            refused = rec.WorkspaceApply(
                path=str(where),
                ok=False,
                method="none",
                files=body.files,
                error=str(exc),
                client=client,
                check=check,
            )
            if not check:
                await self._witness(run_id, refused, view.patch_seq)
            raise Conflict(f"run {run_id}: {exc}", details={"run": run_id}) from None
        outcome = rec.WorkspaceApply(
            path=str(where),
            ok=True,
            method=applied.method,
            files=applied.files,
            error="already applied" if applied.already else None,
            client=client,
            check=check,
        )
        if not check and not applied.already:
            await self._witness(run_id, outcome, view.patch_seq)
        return outcome

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
        tier: str | None = None,
        member: str | None = None,
        workspace: str | None = None,
    ) -> RunView:
        """Create a run and start driving it; returns once the request is witnessed.

        With a `workspace` its snapshot is taken first (copied, off the loop) and witnessed
        right after the request (`workspace.snapshot`); see `daemon.runs.views`."""
        self._refuse_while_closing()
        known = self._keys.get(idempotency_key)
        if known is not None:
            run_id = await asyncio.shield(known)
            existing = await self.find(run_id)
            if existing.request != request:
                raise Conflict(
                    "this Idempotency-Key was used for a different request",
                    details={"run": run_id},
                )
            return existing
        checked = self._checked(request, plan, lane, max_parallel)
        if checked is not None:  # an agent reads and edits files: it needs some to work on
            agent_needs_view(checked, workspace is not None)
        self._check_target(tier, member)
        budget_limits = limits(budget, self.roster.policy.budget)
        run_id = "r" + uuid.uuid4().hex[:15]  # see table.RUN_ID
        taken = None
        if workspace is not None:
            self._admit()  # a daemon at capacity refuses before it copies anything
            taken = await spaces.snapshot(self.setting, run_id, workspace)
        body = rec.RunRequest(
            request=request,
            lane=lane,
            plan=k.safe(checked.model_dump(mode="json", by_alias=True)) if checked else None,
            budget=rec.Budget(**budget_limits.model_dump()),
            max_parallel=max_parallel,
            barrier=barrier,
            idempotency_key=idempotency_key,
            client=client,
        )
        # Only when set, so a request without them keeps the bytes it always had.
        if tier is not None:
            body.tier = tier
        if member is not None:
            body.member = member
        try:
            self._admit()  # no await from here to the witness: the check and the counts agree
        except Busy:
            if taken is not None:
                await asyncio.to_thread(taken[0].remove)
            raise
        self._requesting.add(run_id)
        claim: asyncio.Future[str] | None = None
        if idempotency_key is not None:
            claim = asyncio.get_running_loop().create_future()
            self._keys.remember(idempotency_key, claim, time.time())
        await self._step(self._request(run_id, body, checked, idempotency_key, claim, taken))
        return self.get(run_id)

    async def _request(
        self,
        run_id: str,
        body: rec.RunRequest,
        checked: Plan | None,
        key: str | None,
        claim: asyncio.Future[str] | None,
        taken: tuple[RunDirs, SnapshotBody] | None = None,
    ) -> None:
        """`submit`'s durable part: witness the request, then settle its key and start it."""
        try:
            request_seq = await self._witness(run_id, body, None)
            if taken is not None:
                self._spaces[run_id] = taken[0]
                await self._witness(
                    run_id, rec.WorkspaceSnapshot(**taken[1].model_dump()), request_seq
                )
        except BaseException as exc:
            if taken is not None:
                self._spaces.pop(run_id, None)
                await asyncio.to_thread(taken[0].remove)
            if claim is not None and key is not None:
                self._keys.forget(key)
                claim.set_exception(exc)
                claim.exception()  # retrieved: no "never retrieved" warning
            raise
        finally:
            self._requesting.discard(run_id)  # applied already, unless it failed
        if claim is not None:
            claim.set_result(run_id)
        self._start(run_id, fresh=checked)

    def _checked(
        self,
        request: str,
        plan: Plan | dict[str, Any] | None,
        lane: str | None,
        max_parallel: int | None,
    ) -> Plan | None:
        """A submit's arguments checked before anything is witnessed: its plan, if it has one."""
        lanes = self.setting.lanes
        if not request.strip(" \t\n\r\f\v") and plan is None:  # the `submit` schema's rule
            raise InvalidInput("the request is empty")
        if lane is not None and lane not in lanes:
            raise NotFound(f"no lane {lane!r}", details={"lane": lane})
        if max_parallel is not None and max_parallel < 1:
            raise InvalidInput("max_parallel must be at least 1")
        if plan is None:
            return None
        checked = plan if isinstance(plan, Plan) else Plan.model_validate(plan)
        check_plan(checked, lanes)
        admit_commands(checked, self.roster.policy.command, self.options.confinement.hidden)
        spaces.admit(checked, self.roster.policy.command)
        return checked

    def _admit(self) -> None:
        """Bound the runs in memory: `max_runs` execute, `max_queued_runs` more wait queued."""
        policy = self.roster.policy
        admitted = self.census.active() + len(self._requesting)
        if admitted >= policy.max_runs + policy.max_queued_runs:
            raise Busy(
                f"tally is at capacity: {policy.max_runs} runs executing and "
                f"{policy.max_queued_runs} queued; retry later",
                retry_after=5.0,
                details={"max_runs": policy.max_runs, "max_queued_runs": policy.max_queued_runs},
            )

    def _check_target(self, tier: str | None, member: str | None) -> None:
        """A client's choice of tier or member for one run: one of them, and in the roster."""
        roster = self.roster
        if tier is not None and member is not None:
            raise InvalidInput("choose a tier or a member for the run, not both")
        if tier is not None and tier not in roster.tiers.members:
            known = ", ".join(roster.tiers.ladder) or "none"
            raise NotFound(
                f"no tier {tier!r} in the roster (its ladder: {known})", details={"tier": tier}
            )
        if member is not None and roster.member(member) is None:
            known = ", ".join(m.name for m in roster.models)
            raise NotFound(
                f"no member {member!r} in the roster (its members: {known})",
                details={"member": member},
            )

    async def retry(self, run_id: str, client: str = "owner") -> RunView:
        """A new run for a failed, cancelled or budget-exhausted run, linked to it and reusing
        its done tasks (see `reuse`); on a workspace, on a fresh snapshot of it (`reuse.fresh`)
        that the done tasks' changes are carried onto."""
        self._refuse_while_closing()
        original = await self.find(run_id)
        plan = reuse.retryable(original)
        lane = original.lane if original.lane in self.setting.lanes else None
        checked = self._checked(original.request, plan, lane, original.max_parallel)
        body = reuse.retry_request(original, checked, lane, self.roster, client)
        new_id = "r" + uuid.uuid4().hex[:15]  # see table.RUN_ID
        self._admit()
        taken = None
        if original.workspace is not None:
            taken = await reuse.fresh(self.setting, new_id, original)
            try:
                self._admit()  # checked again after the copy: no await from here to the witness
            except Busy:
                await asyncio.to_thread(taken[0].remove)
                raise
        self._requesting.add(new_id)
        await self._step(self._request(new_id, body, checked, None, None, taken))
        return self.get(new_id)

    async def cancel(self, run_id: str, reason: str = "cancelled by request") -> RunView:
        if run_id not in self.table.views:  # a summary or nothing: finished long ago
            return await self.find(run_id)
        view = self.get(run_id)
        if view.state in FINAL:
            return view
        run = self._runs.get(run_id)
        if run is None:  # interrupted: nothing runs, record the decision
            await self._step(self._cancel_stopped(view, reason))
            return self.get(run_id)
        if not run.cancelling:
            run.cancelling = True  # checked before every task start: none starts after this
            await self._step(self._cancel_running(run, view, reason))
        await run.finished.wait()
        return self.get(run_id)

    async def _cancel_stopped(self, view: RunView, reason: str) -> None:
        seq = await self._witness(view.id, rec.RunCancel(reason=reason), view.request_seq)
        await self._witness(view.id, rec.RunState(state="cancelled", error=reason), seq)
        self._retire(view.id)

    async def _cancel_running(self, run: Run, view: RunView, reason: str) -> None:
        await self._witness(view.id, rec.RunCancel(reason=reason), view.request_seq)
        await self._abort(run)

    async def resume(self, run_id: str) -> RunView:
        self._refuse_while_closing()
        if run_id not in self.table.views:  # a summary or nothing: finished long ago
            view = await self.find(run_id)
            raise Conflict(f"run {run_id} is {view.state}; only an interrupted run resumes")
        view = self.get(run_id)
        if view.state != "interrupted" or run_id in self._runs:
            raise Conflict(f"run {run_id} is {view.state}; only an interrupted run resumes")
        done = [t.id for t in view.tasks if t.state == "done"]
        redo = [t.id for t in view.tasks if t.state != "done"]
        body = rec.RunResume(
            reused=done,
            redo=redo,
            stage="dispatch" if view.plan_seq is not None else "route",
            spent=rec.Budget(**view.spent.model_dump()),
        )
        self._admit()
        await self._step(self._resume(run_id, body, view.answer_seq or view.request_seq))
        return self.get(run_id)

    def _refuse_while_closing(self) -> None:
        """No run starts once shutdown began: 503 with Retry-After, a restarted daemon takes
        it (shutdown only waits for the steps already in flight)."""
        if self._closing:
            raise Busy("the daemon is stopping; retry once it is back", retry_after=5.0)

    async def _step(self, work: Coroutine[Any, Any, T]) -> T:
        """Await `work` to its end even if the caller is cancelled; the caller still is (module
        doc). Its first step runs before any step the caller takes after a cancellation, so its
        appends keep their order before the ones a cancellation handler makes."""
        task = asyncio.ensure_future(work)
        task.add_done_callback(_retrieve)
        self._steps.add(task)
        task.add_done_callback(self._steps.discard)
        return await asyncio.shield(task)

    async def _resume(self, run_id: str, body: rec.RunResume, parent: int | None) -> None:
        await self._witness(run_id, body, parent)
        self._start(run_id, fresh=None)

    async def restore(self, snapshot: Snapshot | None = None) -> builtins.list[str]:
        """Rebuild run state from the ledger; every run found in flight becomes interrupted.

        With a `snapshot` (already checked against the ledger) only the entries after it are
        replayed; a redaction among them makes it replay everything instead.
        """
        views, self.restored_from = await self.table.restore(self.ledger, snapshot)
        for view in views.values():
            if view.idempotency_key is not None:
                done: asyncio.Future[str] = asyncio.get_running_loop().create_future()
                done.set_result(view.id)
                self._keys.remember(view.idempotency_key, done, view.started_at_us / 1e6)
        interrupted: builtins.list[RunView] = []
        for view in list(views.values()):
            if view.state in STOPPED:
                if view.state in FINAL:
                    self._retire(view.id)
                continue
            interrupted.append(view)
        # Each hangs off its own run's request: appended at once, they share group commits.
        outcomes = await asyncio.gather(
            *(self._interrupted(view) for view in interrupted), return_exceptions=True
        )
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
        return [view.id for view in interrupted]

    async def _interrupted(self, view: RunView) -> None:
        """Reconcile: a run the record shows in flight ends interrupted (actor "daemon")."""
        said = rec.RunInterrupted(
            reason="the daemon stopped while the run was in flight",
            previous=view.state,
            spent_wall_ms=view.spent.wall_ms,
        )

        def applied(entry: EntryLike) -> None:
            self.table.apply(entry.seq, entry.ts, k.INTERRUPTED, view.id, said)

        await self.ledger.append(
            actor="daemon",
            kind=rec.RunInterrupted.KIND,
            body=said.written(),
            run=view.id,
            parent=view.request_seq,
            on_commit=applied,
        )

    def snapshot(self) -> tuple[int, builtins.list[RunView], builtins.list[bytes]]:
        """(ledger size, a copy of every full run view, every summary's JSON) at one instant.

        Every run entry is applied in the step that commits it (the ledger's `on_commit`, in
        the step its size grows), so the views are exactly the reduction of the ledger's first
        `size` entries (only the engine writes run entries). Nothing in the list changes
        afterwards (see `RunTable.frozen`).
        """
        views, summaries = self.table.frozen()
        return self.ledger.size, views, summaries

    async def shutdown(self, drain_s: float = 5.0) -> None:
        """Let runs finish for `drain_s`, then interrupt the rest (witnessed, resumable)."""
        self._closing = True
        if self._steps:  # a submit or resume whose entry is committing starts its run first
            await asyncio.wait(list(self._steps))
        active = [run for run in self._runs.values() if run.task is not None]
        if active and drain_s > 0:
            waiters = [asyncio.create_task(run.finished.wait()) for run in active]
            await asyncio.wait(waiters, timeout=drain_s)
            for waiter in waiters:
                waiter.cancel()
        for run in list(self._runs.values()):
            if run.task is not None and not run.task.done():
                run.interrupting = True
                await self._abort(run)
        for run in list(self._runs.values()):
            await run.finished.wait()

    async def _abort(self, run: Run) -> None:
        # A task cancelled before its first step never runs its handlers: let it start first.
        await run.started.wait()
        if run.task is not None:
            run.task.cancel()

    # ---------------------------------------------------------------- witnessing

    async def _witness(self, run_id: str, typed: rec.Body, parent: int | None) -> int:
        kind, body = typed.KIND, typed.written()
        entry = await self.ledger.append(
            actor=k.ACTOR,
            kind=kind,
            body=body,
            run=run_id,
            parent=parent,
            on_commit=functools.partial(self._applied, run_id, typed, body),
        )
        return int(entry.seq)

    def _applied(
        self, run_id: str, typed: rec.Body, body: dict[str, Any], entry: EntryLike
    ) -> None:
        """The ledger's `on_commit` for a run entry: apply it to its view, then publish it.
        The view reads the model witnessed (no parsing back of what was just written)."""
        kind = typed.KIND
        self.table.apply(entry.seq, entry.ts, kind, run_id, typed)
        if kind == k.REQUEST:
            self._requesting.discard(run_id)  # counted in the census from this step on
        self.feed.publish(run_id, entry, typed, body)

    async def _witness_all(
        self, run_id: str, entries: Sequence[tuple[rec.Body, int | None]]
    ) -> builtins.list[int]:
        """`_witness` for entries whose parents are all durable already: appended at once, so
        they share a group commit. Their seqs follow the list's order (the ledger takes appends
        in the order they are made), and each is applied and published in that order; every
        entry the ledger took is applied even if another failed, then the first error raises.
        """
        appended = await asyncio.gather(
            *(self._witness(run_id, body, parent) for body, parent in entries),
            return_exceptions=True,
        )
        seqs: builtins.list[int] = []
        for outcome in appended:
            if isinstance(outcome, BaseException):
                raise outcome
            seqs.append(outcome)
        return seqs

    def _retire(self, run_id: str) -> None:
        self.table.retire(run_id, self.roster.policy)

    # ---------------------------------------------------------------- driving a run

    def _start(self, run_id: str, fresh: Plan | None) -> None:
        view = self.table.views[run_id]
        run = Run(
            id=run_id,
            meter=Meter(view.budget, view.spent),
            client_plan=fresh,
            fresh=view.state == "queued" and view.plan is None,
            space=self._spaces.pop(run_id, None),
        )
        for task in view.tasks:
            if task.state == "done" and task.result is not None:
                run.outputs[task.id] = task.result
        self._runs[run_id] = run
        run.task = asyncio.create_task(self._drive(run), name=f"run {run_id}")

    async def _drive(self, run: Run) -> None:
        view = self.table.views[run.id]
        try:
            await lifecycle.drive(self.setting, run, self._work)
        finally:
            await spaces.close(run)  # its snapshot and views: the patch is in the record
            self._runs.pop(run.id, None)
            run.finished.set()
            if view.state in FINAL:
                self._retire(run.id)

    async def _work(self, run: Run) -> None:
        """The steps, in order: a run resumed past its plan goes straight to its waves."""
        s = self.setting
        view = self.table.views[run.id]
        if view.plan is None:
            if not run.fresh:  # resumed before planning: the client's plan is in the request
                requested = await planning.requested_plan(self.ledger, view)
                if requested is not None:
                    run.client_plan = requested
            lane, parent = await routing.route(s, run)
            await planning.plan(s, run, lane, parent)
        assert view.plan is not None
        assert view.plan_seq is not None
        plan = Plan.model_validate(k.unsafe(view.plan))
        if view.retry_of is not None:
            await reuse.reuse(s, run, self.find, self._witness_all)
        try:
            await tasks.run_plan(s, run, plan)
        except TaskFailed as exc:  # the done tasks' work is still the run's answer
            await spaces.partial_patch(s, run, plan)  # and their changes its patch
            await synthesis.partial(s, run, describe(exc))
            raise
        await spaces.patch(s, run, plan)
        answer_seq = await synthesis.synthesize(s, run, plan)
        intent = checks.intent(view.request, view.answer or "")
        done = rec.RunState(state="done", error=None)
        # Both hang off the answer, which is durable: one group commit instead of two in turn.
        await self._witness_all(run.id, [(rec.RunIntent(**intent), answer_seq), (done, answer_seq)])


def _retrieve(task: asyncio.Future[Any]) -> None:
    """Mark the outcome seen: a caller that was cancelled no longer reads it (its error, if
    any, is the ledger's or the run's and is reported there)."""
    if not task.cancelled():
        task.exception()
