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

A run on a workspace is retried on the workspace as it is now (`fresh`: its snapshot taken
again and witnessed as the new run's `workspace.snapshot`; a workspace gone, or no longer the
git repository it was, is refused before anything is witnessed). Each reused task's recorded
`task.diff` is carried onto that snapshot (`daemon.workspace.carry`): witnessed first as one
`workspace.carry` (parent: the plan) saying which tasks are carried, which of their files
changed since the original saw them, and which run again and why (a diff that no longer
applies, or a task that needs one that runs again); then each carried task's `task.reuse`
and its `task.diff` (attempt 0, parent: that `task.reuse`) against the new snapshot, from
which views, the run's patch and a restart read it.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import Awaitable, Callable, Sequence

from daemon import record as rec
from daemon.errors import Conflict
from daemon.plans import Plan
from daemon.runs import entries as k
from daemon.runs import views as spaces
from daemon.runs.context import Run, Setting
from daemon.runs.state import RunView
from daemon.workspace import record as ws
from daemon.workspace.carry import Carried, Reused, carry
from daemon.workspace.git import GitFailed
from daemon.workspace.view import RunDirs
from roster.models import Roster

RETRYABLE: frozenset[str] = frozenset({"failed", "cancelled", "budget_exhausted"})
"""States a run is retried from (an interrupted one resumes instead)."""

Find = Callable[[str], Awaitable[RunView]]
WitnessAll = Callable[[str, Sequence[tuple[rec.Body, int | None]]], Awaitable[list[int]]]


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
    asked = rec.RunRequest.parsed(named)  # redacted or not a request's: nothing to reuse
    listed = asked.retry_of.reuse if asked is not None and asked.retry_of is not None else []
    pending = [task_id for task_id in listed if (t := view.task(task_id)) and t.state != "done"]
    if not pending:
        return
    original = await find(view.retry_of)
    carried = None
    if view.workspace is not None:
        pending, carried = await _carry(s, run, original, pending)
    entries: list[tuple[rec.Body, int | None]] = []
    taken: list[str] = []
    for task_id in pending:
        done = original.task(task_id)
        if done is None or done.state != "done":
            continue
        output = done.result or ""
        body = rec.TaskReuse(
            task=task_id, from_run=original.id, from_seq=done.verdict_seq, output=output
        )
        entries.append((body, view.plan_seq))
        taken.append(task_id)
        run.outputs[task_id] = output
    seqs = await witness_all(run.id, entries)
    if carried is not None and taken:
        diffs: list[tuple[rec.Body, int | None]] = [
            (
                rec.TaskDiff(
                    task=task_id,
                    attempt=0,
                    diff=carried.diffs[task_id],
                    files=carried.files[task_id],
                ),
                seq,
            )
            for task_id, seq in zip(taken, seqs, strict=True)
        ]
        await witness_all(run.id, diffs)


async def fresh(s: Setting, run_id: str, original: RunView) -> tuple[RunDirs, ws.SnapshotBody]:
    """The snapshot of `original`'s workspace as it is now, for the run `run_id` that retries
    it. Conflict, with nothing taken or witnessed, when the workspace is gone, unreadable, or
    no longer the git repository the original saw."""
    path = original.workspace
    assert path is not None
    again = (
        f"or submit the request again on the project as it is now: `tally submit --workspace "
        f"DIR …` (`tally patch {original.id}` still shows what its done tasks changed)"
    )
    details = {"run": original.id, "workspace": path}
    if not await asyncio.to_thread(os.path.isdir, path):
        raise Conflict(
            f"run {original.id} worked on the workspace {path}, which is no longer a directory "
            f"(deleted or moved); a retry works on the workspace as it is now: put it back, "
            + again,
            details=details,
        )
    seen = await spaces.witnessed(s, original.id, original.request_seq, rec.WorkspaceSnapshot)
    try:
        space, body = await spaces.snapshot(s, run_id, path)
    except (GitFailed, OSError, subprocess.SubprocessError) as exc:
        raise Conflict(
            f"run {original.id}: its workspace {path} cannot be read now ({exc}); repair it, "
            + again,
            details=details,
        ) from None
    if seen and seen[0].kind == "git" and body.kind != "git":
        await asyncio.to_thread(space.remove)
        head = (seen[0].head or "")[:12]
        raise Conflict(
            f"run {original.id} worked on {path} as a git repository (HEAD {head or 'unborn'}), "
            f"and it is not the top of one now (its .git is gone or broken); a retry carries "
            f"the done tasks' changes onto the repository as it is now: restore {path}/.git, "
            + again,
            details=details,
        )
    return space, body


async def _carry(
    s: Setting, run: Run, original: RunView, pending: list[str]
) -> tuple[list[str], Carried]:
    """Carry the pending tasks' recorded diffs onto this run's snapshot (off the loop) and
    witness `workspace.carry`; returns the tasks carried (to reuse) and what was carried.
    A resumed retry carried once already: the tasks that carry sent to run again stay so."""
    view = s.views[run.id]
    before = await spaces.witnessed(s, run.id, view.request_seq, rec.WorkspaceCarry)
    decided: set[str] = set()
    for earlier in before:
        decided |= set(earlier.redo)
    order = [t.id for t in view.tasks if t.id in pending and t.id not in decided]
    recorded = await spaces.last_diffs(s, original.id, original.request_seq, order)
    known = {t.id: await spaces.diff_of(s, run, t.id) for t in view.tasks if t.state == "done"}
    space = await spaces.space_of(s, run)
    items = [
        Reused(task_id, spaces.ancestors(view, task_id), recorded[task_id])
        for task_id in order
        if task_id in recorded
    ]
    carried = await asyncio.to_thread(carry, space, items, known)
    for task_id in order:
        if task_id not in recorded:
            carried.redo[task_id] = f"run {original.id}'s record holds no readable diff of it"
    run.diffs.update(carried.diffs)
    if not before or carried.redo:
        body = rec.WorkspaceCarry(
            from_run=original.id,
            from_content=original.workspace_content,
            content=view.workspace_content or "",
            carried=[t for t in order if t in carried.diffs],
            changed=carried.changed,
            redo=carried.redo,
        )
        await s.witness(run.id, body, view.plan_seq)
    return [t for t in order if t in carried.diffs], carried
