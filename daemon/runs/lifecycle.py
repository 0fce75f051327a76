"""A run's life around its steps: the run gate, the wall clock, and how a run ends.

`drive` runs a run's `work` (route → plan → waves → synthesis, in the engine) once the run
passes the daemon's run gate (`max_runs`), under its wall-clock budget (what earlier attempts
spent counts against it), and witnesses how it ends when the work does not end it itself:
- a budget exhausted (calls, tokens or wall): `run.budget` (parent: the request) with the
  limit, the budget and what was spent, the done tasks' results as a `partial` answer (see
  `synthesis.partial`; none if no task is done), then `run.state` budget_exhausted (parent:
  the budget entry);
- a cancellation by request: `run.state` cancelled (the `run.cancel` entry is the engine's);
- the daemon stopping (`interrupting`, not cancelling): `run.interrupted` (parent: the
  request) with the wall time spent up to now — resumable;
- any other error: `run.state` failed with the error.
`final` witnesses a `run.state` (parent: the given seq, else the request).
Guarantees: `run.started` is set before anything can be awaited (a cancel waits for it, so
these handlers always run); a cancellation that ends the run is absorbed here (`uncancel`),
so the caller's own clean-up runs in a task that is not cancelled.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from daemon import record as rec
from daemon.runs import synthesis
from daemon.runs.budget import BudgetExhausted
from daemon.runs.context import Run, Setting, describe


async def drive(s: Setting, run: Run, work: Callable[[Run], Awaitable[None]]) -> None:
    run.started.set()
    view = s.views[run.id]
    try:
        elapsed_ms = view.wall_base_ms + (time.time_ns() // 1000 - view.started_at_us) // 1000
        wall = asyncio.timeout(run.meter.wall_s(elapsed_ms))
        try:
            async with wall, s.waits.gate(run.id, s.gate):  # `queued` while at the gate
                if run.cancelling:
                    raise asyncio.CancelledError
                await work(run)
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
        seq = await s.witness(
            run.id,
            rec.RunBudget(
                limit=exc.limit,
                budget=rec.Budget(**view.budget.model_dump()),
                spent=rec.Budget(**spent),
            ),
            view.request_seq,
        )
        if view.answer_seq is None:  # the work done within the budget is still its answer
            await synthesis.partial(s, run, f"budget exhausted: {exc.limit}")
        await final(s, run, "budget_exhausted", f"budget exhausted: {exc.limit}", seq)
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None:
            task.uncancel()
        if run.interrupting and not run.cancelling:
            now_us = time.time_ns() // 1000
            wall_ms = view.wall_base_ms + (now_us - view.started_at_us) // 1000
            body = rec.RunInterrupted(
                reason="the daemon stopped",
                previous=view.state,
                spent_wall_ms=max(view.spent.wall_ms, wall_ms),
            )
            await s.witness(run.id, body, view.request_seq)
        else:
            await final(s, run, "cancelled", "cancelled by request", None)
    except Exception as exc:
        await final(s, run, "failed", describe(exc), None)


async def final(s: Setting, run: Run, state: str, error: str | None, parent: int | None) -> None:
    view = s.views[run.id]
    await s.witness(run.id, rec.RunState(state=state, error=error), parent or view.request_seq)
