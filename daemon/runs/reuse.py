"""Retrying a run that ended without finishing: a new run that reuses the original's work.

`tally retry RUN` (tool `run_retry`) takes a failed, cancelled or budget-exhausted run
(`retryable`) and starts a new run (`retry_request`) with the same request, plan, lane,
budget and client choices (tier, member), whose `run.request` names the original in
`retry_of` {run, state, reuse}: the tasks it had done. The original stays as it ended (its
record never changes); the link is the new run's, so both are read in one pass of replay.

Once the new run's plan is witnessed, `reuse` takes each of those tasks as done: one
`task.reuse` entry each (parent: the plan) with the original's output and the seq of its done
verdict, so what a dependant reads and the answer's results are exactly the original's. The
others run as in any run. A retried run interrupted by a stop resumes like any other: tasks
already reused stay reused.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from daemon import record as rec
from daemon.errors import Conflict
from daemon.planning import Plan
from daemon.runs import entries as k
from daemon.runs.context import Run, Setting
from daemon.runs.state import RunView
from roster.models import Roster

RETRYABLE: frozenset[str] = frozenset({"failed", "cancelled", "budget_exhausted"})
"""States a run is retried from (an interrupted one resumes instead)."""

Find = Callable[[str], Awaitable[RunView]]
WitnessAll = Callable[[str, Sequence[tuple[rec.Body, int | None]]], Awaitable[Any]]


def retryable(original: RunView) -> Plan | None:
    """The original's plan (None: it ended before it had one); Conflict if it cannot retry."""
    if original.state not in RETRYABLE:
        hint = "; an interrupted run resumes instead" if original.state == "interrupted" else ""
        raise Conflict(
            f"run {original.id} is {original.state}; only a failed, cancelled or "
            f"budget-exhausted run is retried{hint}",
            details={"run": original.id, "state": original.state},
        )
    if original.plan is None:
        return None
    return Plan.model_validate(k.unsafe(original.plan))


def retry_request(
    original: RunView, plan: Plan | None, lane: str | None, roster: Roster, client: str
) -> rec.RunRequest:
    """The `run.request` body of the run that retries `original` (plan checked already)."""
    tier = original.tier if original.tier in roster.tiers.members else None
    member = original.member if original.member and roster.member(original.member) else None
    reused = [t.id for t in original.tasks if t.state == "done"] if plan is not None else []
    body = rec.RunRequest(
        request=original.request,
        lane=lane,
        plan=k.safe(plan.model_dump(mode="json", by_alias=True)) if plan else None,
        budget=rec.Budget(**original.budget.model_dump()),
        max_parallel=original.max_parallel,
        barrier=original.barrier,
        idempotency_key=None,
        client=client,
        retry_of=rec.RetryOf(run=original.id, state=original.state, reuse=reused),
    )
    if tier is not None:  # only when set, as in a new run's request
        body.tier = tier
    if member is not None:
        body.member = member
    return body


async def reuse(s: Setting, run: Run, find: Find, witness_all: WitnessAll) -> None:
    """Witness `task.reuse` for each task the request names that is not done here yet (all of
    them at once: one group commit), and hand their outputs to the run."""
    view = s.views[run.id]
    assert view.retry_of is not None
    request = await s.ledger.entries(start=view.request_seq, limit=1, run=run.id)
    named = (await s.ledger.read_bodies([request[0].body]))[0][1] if request else None
    retry_of = named.get("retry_of") if isinstance(named, dict) else None
    listed = retry_of.get("reuse") if isinstance(retry_of, dict) else None
    pending = [
        task_id
        for task_id in (listed if isinstance(listed, list) else [])
        if isinstance(task_id, str) and (t := view.task(task_id)) and t.state != "done"
    ]
    if not pending:
        return
    original = await find(view.retry_of)
    entries: list[tuple[rec.Body, int | None]] = []
    for task_id in pending:
        done = original.task(task_id)
        if done is None or done.state != "done":
            continue
        output = done.result or ""
        body = rec.TaskReuse(
            task=task_id, from_run=original.id, from_seq=done.verdict_seq, output=output
        )
        entries.append((body, view.plan_seq))
        run.outputs[task_id] = output
    await witness_all(run.id, entries)
