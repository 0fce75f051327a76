"""The replay reducer: run state from ledger entries alone.

The engine feeds every entry it witnesses through `apply`, and replay feeds the stored
entries through the same function, so live state and replayed state are equal by
construction (a test checks it). No model is called: replies are in the record.

Each reducer reads its kind's model (`daemon.record`): the engine hands over the model it
witnessed (no parsing on its hot path), replay reads the stored body into it once. A body that
is not there (redacted, missing) or does not fit its kind (hostile, or a shape tally never
wrote: `tally ledger verify --deep` names those by seq) reaches its reducer as None: the entry
still counts for what its kind alone says (a model call was made, the run was interrupted),
and nothing is read from fields whose types cannot be trusted. A run's view stays what the
rest of its record says instead of replay failing on one entry; a misfit is logged (once per
kind), so it is not silent.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, get_args

from pydantic import ValidationError

from daemon import record as rec
from daemon.runs import entries as k
from daemon.runs.ports import LedgerReader
from daemon.runs.state import FINAL, Limits, RunState, RunView, TaskView
from daemon.workspace import record as ws

log = logging.getLogger(__name__)

_STATES: dict[str, RunState] = {state: state for state in get_args(RunState)}
_misfit_kinds: set[str] = set()
"""Kinds a misfit body was logged for (once each: a replay of a long ledger logs a few lines)."""


def typed(kind: str, body: object) -> rec.Body | None:
    """`body` as its kind's model: None when it is absent or does not fit (see the module
    doc), or when the kind is not the record's (no reducer reads those)."""
    if isinstance(body, rec.Body):
        return body if kind == body.KIND else None
    model = rec.model_for(kind)
    if model is None or body is None:
        return None
    try:
        return model.read(body)
    except ValidationError as err:
        if kind not in _misfit_kinds:
            _misfit_kinds.add(kind)
            log.warning("a %s body does not fit its kind, read as absent: %s", kind, err)
        return None


def _task(view: RunView, task: str | None) -> TaskView | None:
    return None if task is None else view.task(task)


def apply(
    views: dict[str, RunView], seq: int, ts: int, kind: str, run: str | None, body: object
) -> RunView | None:
    """Apply one entry; return the run's view it changed (None if the entry is not a run's).
    `body` is the kind's model (the engine's) or the body as stored (replay's)."""
    if run is None:
        return None
    if kind == k.REQUEST:
        b = typed(kind, body)
        views[run] = view = _request(run, seq, ts, b if isinstance(b, rec.RunRequest) else None)
        return view
    found = views.get(run)
    if found is None:
        return None  # not a run this reduction knows: its body is not read at all
    view = found
    view.updated_at_us = ts
    if view.state not in FINAL and view.state != "interrupted" and kind != k.INTERRUPTED:
        # Wall time counts while the run is driven: earlier attempts plus this one. The time
        # between a crash and the reconcile is not the run's (see run.interrupted).
        active = view.wall_base_ms + (ts - view.started_at_us) // 1000
        view.spent.wall_ms = max(view.spent.wall_ms, active)
    reducer = _REDUCERS.get(kind)
    if reducer is not None:  # only a kind with a reducer has its body read
        reducer(view, seq, ts, typed(kind, body))
    return view


def _request(run: str, seq: int, ts: int, b: rec.RunRequest | None) -> RunView:
    """A run's view from its request (a redacted request leaves its text "", the rest as
    its defaults). One constructor call: a pydantic model's attribute sets cost more."""
    at = {"request_seq": seq, "created_at_us": ts, "updated_at_us": ts, "started_at_us": ts}
    if b is None:
        return RunView(id=run, request="", **at)
    budget = b.budget
    return RunView(
        id=run,
        request=b.request,
        client=b.client,
        lane=b.lane,
        budget=Limits(model_calls=budget.model_calls, tokens=budget.tokens, wall_ms=budget.wall_ms),
        idempotency_key=b.idempotency_key,
        max_parallel=b.max_parallel,
        barrier=b.barrier,
        tier=b.tier,
        member=b.member,
        retry_of=None if b.retry_of is None else b.retry_of.run,
        **at,
    )


def _route(view: RunView, seq: int, ts: int, b: rec.RunRoute | None) -> None:
    """`routing` while the lane is still open, `planning` once the route decides it.

    The router escalates (no lane, or too close to call) → the engine asks the classifier
    (or takes the lane from the client's plan) and the run reads `routing` until run.classify
    or run.plan. A confident keyword route, or a lane the client named, decides at once and
    the run goes queued → planning: routing by keywords is synchronous — the run passes the
    `max_runs` gate, the router scores the request and run.route is appended with no await
    in between — so no entry marks its start, and a `routing` state there would last one
    fsync and cost an extra entry per run. `queued` stays what it says: waiting for the gate.
    """
    view.lane = None if b is None else b.lane
    decided = b is not None and b.lane is not None and not b.escalate
    view.state = "planning" if decided else "routing"


def _classify(view: RunView, seq: int, ts: int, b: rec.RunClassify | None) -> None:
    view.lane = None if b is None else b.lane
    view.state = "planning"


def _plan(view: RunView, seq: int, ts: int, b: rec.RunPlan | None) -> None:
    # The plan is the published plan as `safe` wrote it (floats wrapped): the view holds it as
    # that JSON, and its tasks are read from it the way the plan schema states them.
    plan = b.plan if b is not None and b.plan else {"tasks": []}
    view.plan = plan
    view.plan_seq = seq
    view.tasks = [
        TaskView(
            id=t["id"],
            lane=t.get("lane", ""),
            executor=t.get("executor", "chat"),
            needs=list(t.get("needs", [])),
        )
        for t in plan.get("tasks", [])
    ]
    view.state = "running"


def _task_start(view: RunView, seq: int, ts: int, b: rec.TaskStart | None) -> None:
    task = None if b is None else _task(view, b.task)
    if b is not None and task is not None:
        task.state = "running"
        task.started_at_us = task.started_at_us or ts
        task.ended_at_us = None
        task.attempts = b.attempt
        task.tier = b.tier
        task.error = None


def _model_call(view: RunView, seq: int, ts: int, b: rec.ModelCall | None) -> None:
    view.spent.model_calls += 1
    if b is None:
        return
    if b.purpose == "synthesize":
        view.state = "synthesizing"
    elif b.purpose == "classify":
        view.state = "routing"
    task = _task(view, b.task) if b.purpose == "task" else None
    if task is not None:
        task.member = b.member


def _model_reply(view: RunView, seq: int, ts: int, b: rec.ModelReply | None) -> None:
    if b is not None:
        view.spent.tokens += b.tokens()


def _agent_step(view: RunView, seq: int, ts: int, b: rec.AgentStep | None) -> None:
    """One step of an agent task's loop: one model call and its tokens, and the task's steps."""
    view.spent.model_calls += 1
    if b is None:
        return
    view.spent.tokens += b.tokens.prompt + b.tokens.completion
    task = _task(view, b.task)
    if task is not None:
        task.steps += 1
        task.last_tool = b.tool
        task.member = b.member or task.member


def _task_result(view: RunView, seq: int, ts: int, b: rec.TaskResult | None) -> None:
    task = None if b is None else _task(view, b.task)
    if b is not None and task is not None:
        task.result = b.output
        task.error = b.error


def _task_verdict(view: RunView, seq: int, ts: int, b: rec.TaskVerdict | None) -> None:
    task = None if b is None else _task(view, b.task)
    if b is None or task is None:
        return
    task.failures = list(b.failures)
    task.verdict_seq = seq
    if b.next in ("done", "failed"):
        task.ended_at_us = ts
    if b.next == "done":
        task.state = "done"
    elif b.next == "failed":
        task.state = "failed"
        task.error = task.error or "; ".join(task.failures) or "failed"
    else:
        task.state = "pending"


def _task_skip(view: RunView, seq: int, ts: int, b: rec.TaskSkip | None) -> None:
    task = None if b is None else _task(view, b.task)
    if b is not None and task is not None:
        task.state = "skipped"
        task.error = b.reason
        task.ended_at_us = ts


def _task_reuse(view: RunView, seq: int, ts: int, b: rec.TaskReuse | None) -> None:
    task = None if b is None else _task(view, b.task)
    if b is not None and task is not None:
        task.state = "done"
        task.result = b.output
        task.error = None
        task.verdict_seq = seq
        task.started_at_us = task.ended_at_us = ts
        task.reused_from = b.from_run


def _answer(view: RunView, seq: int, ts: int, b: rec.RunAnswer | None) -> None:
    view.answer = None if b is None else b.answer
    view.answer_seq = seq


def _state(view: RunView, seq: int, ts: int, b: rec.RunState | None) -> None:
    # A final state the record cannot say (redacted, or one tally never writes) is not
    # guessed: the view keeps the state the rest of the record gave it.
    state = None if b is None else _STATES.get(b.state)
    if b is None or state is None:
        return
    view.state = state
    view.error = b.error
    if view.state in FINAL:
        for task in view.tasks:
            if task.state in ("running", "pending") and view.state != "done":
                task.state = "cancelled"


def _interrupted(view: RunView, seq: int, ts: int, b: rec.RunInterrupted | None) -> None:
    if b is not None and b.spent_wall_ms is not None:
        view.spent.wall_ms = max(view.spent.wall_ms, b.spent_wall_ms)
    view.state = "interrupted"
    view.error = None if b is None else b.reason
    for task in view.tasks:
        if task.state == "running":
            task.state = "pending"


def _resume(view: RunView, seq: int, ts: int, b: rec.RunResume | None) -> None:
    view.state = "running" if view.plan is not None else "queued"
    view.error = None
    view.started_at_us = ts
    view.wall_base_ms = view.spent.wall_ms


def _snapshot(view: RunView, seq: int, ts: int, b: rec.WorkspaceSnapshot | None) -> None:
    view.workspace = None if b is None else b.path
    view.workspace_content = None if b is None else b.content


def _patch(view: RunView, seq: int, ts: int, b: rec.RunPatch | None) -> None:
    view.patch_seq = seq
    view.patch_files = [] if b is None else list(b.files)


# Each reducer gets its own kind's model or None: `typed` reads a body only into the model
# registered for the entry's kind, so the `Any` here never hides a mismatch.
_REDUCERS: dict[str, Callable[[RunView, int, int, Any], None]] = {
    ws.SNAPSHOT: _snapshot,
    ws.PATCH: _patch,
    k.ROUTE: _route,
    k.CLASSIFY: _classify,
    k.PLAN: _plan,
    k.TASK_START: _task_start,
    k.MODEL_CALL: _model_call,
    k.MODEL_REPLY: _model_reply,
    k.AGENT_STEP: _agent_step,
    k.TASK_RESULT: _task_result,
    k.TASK_VERDICT: _task_verdict,
    k.TASK_SKIP: _task_skip,
    k.TASK_REUSE: _task_reuse,
    k.ANSWER: _answer,
    k.STATE: _state,
    k.INTERRUPTED: _interrupted,
    k.RESUME: _resume,
}


class RedactedAfterSnapshot(Exception):
    """A redaction came after the snapshot: what replay reads changed, so replay it all."""


async def replay(
    ledger: LedgerReader,
    *,
    until: int | None = None,
    run: str | None = None,
    page: int = 1000,
    start: int = 0,
    views: dict[str, RunView] | None = None,
) -> dict[str, RunView]:
    """Rebuild run views from the ledger alone, as they stood after entry `until` (inclusive).

    `start` and `views` continue from a snapshot (the reduction of entries before `start`);
    a `redaction` entry at or after `start` then raises RedactedAfterSnapshot (the views may
    hold what it removed). Without `views`, `start` only skips entries known not to matter
    (those before a run's request, with `run` given).
    """
    continued = bool(views)
    views = {} if views is None else views
    if start > 0 and continued:
        redactions = await ledger.entries(start=start, limit=1, kind="redaction")
        if redactions and (until is None or redactions[0].seq <= until):
            raise RedactedAfterSnapshot(f"redaction at seq {redactions[0].seq}")
    while True:
        batch = await ledger.entries(start=start, limit=page, run=run, in_run=True)
        if not batch:
            break
        start = batch[-1].seq + 1
        past = until is not None and batch[-1].seq > until
        if until is not None and past:
            batch = [entry for entry in batch if entry.seq <= until]
        bodies = await ledger.read_bodies([entry.body for entry in batch])
        for entry, (_, body) in zip(batch, bodies, strict=True):
            apply(views, entry.seq, entry.ts, entry.kind, entry.run, body)
        if past:
            break
    return views
