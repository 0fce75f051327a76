"""The replay reducer: run state from ledger entries alone.

The engine feeds every entry it witnesses through `apply`, and replay feeds the stored
entries through the same function, so live state and replayed state are equal by
construction (a test checks it). No model is called: replies are in the record.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from daemon.runs import entries as k
from daemon.runs.ports import LedgerReader
from daemon.runs.state import FINAL, Limits, RunView, TaskView
from daemon.workspace import record as ws


def _task(view: RunView, body: dict[str, Any]) -> TaskView | None:
    return view.task(str(body.get("task")))


def apply(
    views: dict[str, RunView], seq: int, ts: int, kind: str, run: str | None, body: Any
) -> RunView | None:
    """Apply one entry; return the run's view it changed (None if the entry is not a run's)."""
    if run is None:
        return None
    b: dict[str, Any] = body if isinstance(body, dict) else {}
    if kind == k.REQUEST:
        view = RunView(
            id=run,
            request=str(b.get("request", "")),
            client=b.get("client"),
            lane=b.get("lane"),
            budget=Limits.model_validate(b.get("budget") or {}),
            request_seq=seq,
            created_at_us=ts,
            updated_at_us=ts,
            started_at_us=ts,
            idempotency_key=b.get("idempotency_key"),
            max_parallel=b.get("max_parallel"),
            barrier=bool(b.get("barrier", False)),
            tier=b.get("tier") if isinstance(b.get("tier"), str) else None,
            member=b.get("member") if isinstance(b.get("member"), str) else None,
        )
        retry_of = b.get("retry_of")
        if isinstance(retry_of, dict) and isinstance(retry_of.get("run"), str):
            view.retry_of = retry_of["run"]
        views[run] = view
        return view
    found = views.get(run)
    if found is None:
        return None
    view = found
    view.updated_at_us = ts
    if view.state not in FINAL and view.state != "interrupted" and kind != k.INTERRUPTED:
        # Wall time counts while the run is driven: earlier attempts plus this one. The time
        # between a crash and the reconcile is not the run's (see run.interrupted).
        active = view.wall_base_ms + (ts - view.started_at_us) // 1000
        view.spent.wall_ms = max(view.spent.wall_ms, active)
    _REDUCERS.get(kind, _ignore)(view, seq, ts, b)
    return view


def _ignore(view: RunView, seq: int, ts: int, b: dict[str, Any]) -> None:
    return None


def _route(view: RunView, seq: int, ts: int, b: dict[str, Any]) -> None:
    """`routing` while the lane is still open, `planning` once the route decides it.

    The router escalates (no lane, or too close to call) → the engine asks the classifier
    (or takes the lane from the client's plan) and the run reads `routing` until run.classify
    or run.plan. A confident keyword route, or a lane the client named, decides at once and
    the run goes queued → planning: routing by keywords is synchronous — the run passes the
    `max_runs` gate, the router scores the request and run.route is appended with no await
    in between — so no entry marks its start, and a `routing` state there would last one
    fsync and cost an extra entry per run. `queued` stays what it says: waiting for the gate.
    """
    view.lane = b.get("lane")
    decided = b.get("lane") is not None and not b.get("escalate")
    view.state = "planning" if decided else "routing"


def _classify(view: RunView, seq: int, ts: int, b: dict[str, Any]) -> None:
    view.lane = b.get("lane")
    view.state = "planning"


def _plan(view: RunView, seq: int, ts: int, b: dict[str, Any]) -> None:
    plan = b.get("plan") or {"tasks": []}
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


def _task_start(view: RunView, seq: int, ts: int, b: dict[str, Any]) -> None:
    task = _task(view, b)
    if task is not None:
        task.state = "running"
        task.started_at_us = task.started_at_us or ts
        task.ended_at_us = None
        task.attempts = int(b.get("attempt", task.attempts + 1))
        task.tier = b.get("tier")
        task.error = None


def _model_call(view: RunView, seq: int, ts: int, b: dict[str, Any]) -> None:
    view.spent.model_calls += 1
    purpose = b.get("purpose")
    if purpose == "synthesize":
        view.state = "synthesizing"
    elif purpose == "classify":
        view.state = "routing"
    task = _task(view, b) if purpose == "task" else None
    if task is not None:
        task.member = b.get("member")


def _model_reply(view: RunView, seq: int, ts: int, b: dict[str, Any]) -> None:
    usage = b.get("usage") or {}
    view.spent.tokens += int(usage.get("prompt_tokens") or 0) + int(
        usage.get("completion_tokens") or 0
    )


def _agent_step(view: RunView, seq: int, ts: int, b: dict[str, Any]) -> None:
    """One step of an agent task's loop: one model call and its tokens, and the task's steps."""
    view.spent.model_calls += 1
    tokens = b.get("tokens") or {}
    view.spent.tokens += int(tokens.get("prompt") or 0) + int(tokens.get("completion") or 0)
    task = _task(view, b)
    if task is not None:
        task.steps += 1
        task.last_tool = b.get("tool")
        task.member = b.get("member") or task.member


def _task_result(view: RunView, seq: int, ts: int, b: dict[str, Any]) -> None:
    task = _task(view, b)
    if task is not None:
        task.result = b.get("output")
        task.error = b.get("error")


def _task_verdict(view: RunView, seq: int, ts: int, b: dict[str, Any]) -> None:
    task = _task(view, b)
    if task is None:
        return
    task.failures = list(b.get("failures", []))
    task.verdict_seq = seq
    nxt = b.get("next")
    if nxt in ("done", "failed"):
        task.ended_at_us = ts
    if nxt == "done":
        task.state = "done"
    elif nxt == "failed":
        task.state = "failed"
        task.error = task.error or "; ".join(task.failures) or "failed"
    else:
        task.state = "pending"


def _task_skip(view: RunView, seq: int, ts: int, b: dict[str, Any]) -> None:
    task = _task(view, b)
    if task is not None:
        task.state = "skipped"
        task.error = b.get("reason")
        task.ended_at_us = ts


def _task_reuse(view: RunView, seq: int, ts: int, b: dict[str, Any]) -> None:
    task = _task(view, b)
    if task is not None:
        task.state = "done"
        task.result = b.get("output")
        task.error = None
        task.verdict_seq = seq
        task.started_at_us = task.ended_at_us = ts
        task.reused_from = b.get("from_run")


def _answer(view: RunView, seq: int, ts: int, b: dict[str, Any]) -> None:
    view.answer = b.get("answer")
    view.answer_seq = seq


def _state(view: RunView, seq: int, ts: int, b: dict[str, Any]) -> None:
    view.state = b["state"]
    view.error = b.get("error")
    if view.state in FINAL:
        for task in view.tasks:
            if task.state in ("running", "pending") and view.state != "done":
                task.state = "cancelled"


def _interrupted(view: RunView, seq: int, ts: int, b: dict[str, Any]) -> None:
    wall = b.get("spent_wall_ms")
    if isinstance(wall, int) and not isinstance(wall, bool):
        view.spent.wall_ms = max(view.spent.wall_ms, wall)
    view.state = "interrupted"
    view.error = b.get("reason")
    for task in view.tasks:
        if task.state == "running":
            task.state = "pending"


def _resume(view: RunView, seq: int, ts: int, b: dict[str, Any]) -> None:
    view.state = "running" if view.plan is not None else "queued"
    view.error = None
    view.started_at_us = ts
    view.wall_base_ms = view.spent.wall_ms


def _snapshot(view: RunView, seq: int, ts: int, b: dict[str, Any]) -> None:
    view.workspace = b.get("path")
    view.workspace_content = b.get("content")


def _patch(view: RunView, seq: int, ts: int, b: dict[str, Any]) -> None:
    view.patch_seq = seq
    view.patch_files = list(b.get("files") or [])


_REDUCERS: dict[str, Callable[[RunView, int, int, dict[str, Any]], None]] = {
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
