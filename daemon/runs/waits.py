"""Who is waiting for a slot right now: the live `queued`/`waiting` states the record lacks.

A task witnessed as started (`task.start`) is `running` in the record from then on, but its
model call may first wait in the pool's queue for a slot lease; a resumed run may wait at the
run gate (`max_runs`). That wait is no entry (the canonical bytes of the existing kinds stay as
they are, and a wait is not a fact worth a fsync), so the engine keeps it here, live, and the
outputs overlay it (`shown`):
- a task that started and waits for its lease shows `waiting`;
- a run with something waiting and nothing executing shows `queued` (at the gate, a run-level
  call such as the classifier or the synthesis waiting for its lease, or every started task
  waiting for its lease);
- a task ready to start but held back by a cap on tasks at once (the daemon's, its lane's, the
  run's `max_parallel`) stays `pending` with `held` saying which (`hold`, from the dispatcher).
Replay (the record alone) never shows either: it rebuilds what was witnessed.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager, contextmanager
from typing import TypeVar

from daemon.runs.state import STOPPED, RunView

T = TypeVar("T")

GRACE_S = 0.05
"""A wait shorter than this is not shown: a person could not see it, and each change of a
live state is an event for every listener."""

Changed = Callable[[str, "str | None", bool], None]
"""Told (run id, task id or None for the run itself, waiting now) on every change."""


class Waits:
    def __init__(self, changed: Changed | None = None) -> None:
        self._by_run: dict[str, Counter[str | None]] = {}
        self._held: dict[str, dict[str, str]] = {}
        self._changed = changed

    def hold(self, run_id: str, held: dict[str, str]) -> None:
        """The run's ready tasks held back by a cap now, with why (`{}`: none)."""
        if held:
            self._held[run_id] = held
        else:
            self._held.pop(run_id, None)

    @contextmanager
    def waiting(self, run_id: str, task: str | None) -> Iterator[None]:
        """Mark `task` of the run (None: the run itself) as waiting while the block lasts."""
        self._begin(run_id, task)
        try:
            yield
        finally:
            self._end(run_id, task)

    @asynccontextmanager
    async def after_grace(self, run_id: str, task: str | None) -> AsyncIterator[None]:
        """`waiting` for a block that usually ends at once (a free slot, an open gate): it is
        marked only once it has lasted GRACE_S, so a wait nobody could see is not reported
        (no `waiting` events, no queued/running flicker) and costs one timer."""
        marked = False

        def mark() -> None:
            nonlocal marked
            marked = True
            self._begin(run_id, task)

        timer = asyncio.get_running_loop().call_later(GRACE_S, mark)
        try:
            yield
        finally:
            timer.cancel()
            if marked:
                self._end(run_id, task)

    def _begin(self, run_id: str, task: str | None) -> None:
        held = self._by_run.setdefault(run_id, Counter())
        held[task] += 1
        if held[task] == 1:
            self._tell(run_id, task, True)

    def _end(self, run_id: str, task: str | None) -> None:
        held = self._by_run.get(run_id)
        if held is None or held[task] <= 0:
            return
        held[task] -= 1
        if held[task] <= 0:
            del held[task]
            if not held:
                self._by_run.pop(run_id, None)
            self._tell(run_id, task, False)

    @asynccontextmanager
    async def lease(
        self, run_id: str, task: str | None, lease: AbstractAsyncContextManager[T]
    ) -> AsyncIterator[T]:
        """Enter `lease` (a slot lease), waiting while it queues; hold it for the block."""
        async with self.after_grace(run_id, task):
            held = await lease.__aenter__()
        try:
            yield held
        except BaseException as exc:
            if not await lease.__aexit__(type(exc), exc, exc.__traceback__):
                raise
        else:
            await lease.__aexit__(None, None, None)

    @asynccontextmanager
    async def gate(self, run_id: str, gate: asyncio.Semaphore) -> AsyncIterator[None]:
        """Pass the run gate, the run waiting (queued) until it may."""
        async with self.after_grace(run_id, None):
            await gate.acquire()
        try:
            yield
        finally:
            gate.release()

    def _tell(self, run_id: str, task: str | None, waiting: bool) -> None:
        if self._changed is not None:
            self._changed(run_id, task, waiting)

    def of(self, run_id: str) -> frozenset[str | None]:
        return frozenset(self._by_run.get(run_id, ()))

    def runs(self) -> list[str]:
        """The runs with something waiting now."""
        return list(self._by_run)

    def shown(self, view: RunView) -> RunView:
        """The view as a person should read it now: a copy with the live waits laid over it
        (the view itself, the record's reduction, is not changed)."""
        held = self._by_run.get(view.id) or Counter()
        capped = self._held.get(view.id) or {}
        if not (held or capped) or view.state in STOPPED:
            return view
        tasks = [
            t.model_copy(update={"state": "waiting"})
            if t.state == "running" and t.id in held
            else t.model_copy(update={"held": capped[t.id]})
            if t.state == "pending" and t.id in capped
            else t
            for t in view.tasks
        ]
        executing = any(t.state == "running" for t in tasks)
        waiting = None in held or any(t.state == "waiting" for t in tasks)
        state = "queued" if waiting and not executing else view.state
        return view.model_copy(update={"tasks": tasks, "state": state})
