"""Runs: submit, read, list, cancel, resume, retry, patch, apply, replay, compare."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Annotated, Any

from pydantic import Field, ModelWrapValidatorHandler, PrivateAttr, model_validator

from daemon import record as rec
from daemon.errors import Busy, Conflict, DeadlineExceeded, NotFound, Unavailable
from daemon.plans import Plan, Task
from daemon.quotas import RateLimited
from daemon.runs import entries as k
from daemon.runs.replay import replay
from daemon.runs.state import RunState
from daemon.tools.roster import _keep_a_bad_plan, _refuse_a_bad_plan
from daemon.tools.tool import (
    NOT_BLANK,
    RunIdIn,
    RunOut,
    Seq,
    Tool,
    ToolContext,
    _In,
    _Out,
    require,
    run_out,
)
from roster.models import NAME, Budget, Whole

if TYPE_CHECKING:
    from daemon.service import Daemon

# ---------------------------------------------------------------- runs


class SubmitIn(_In):
    _unchecked: Any = PrivateAttr(default=None)
    """The plan as sent, when it failed its schema (see `_keep_a_bad_plan`)."""

    @model_validator(mode="wrap")
    @classmethod
    def _one_pass(cls, data: Any, handler: ModelWrapValidatorHandler[SubmitIn]) -> SubmitIn:
        kept: SubmitIn = _keep_a_bad_plan(data, handler)
        return kept

    request: str = Field(
        min_length=1,
        max_length=100_000,
        pattern=NOT_BLANK,
        description="What you want done (not only spaces, tabs and line breaks).",
    )
    plan: Plan | None = Field(
        default=None,
        description=(
            "An explicit task DAG (check it first with the plan tool). Without one, the "
            "roster's coordinator model plans it if one is configured, else the request "
            "runs as one task in its routed lane."
        ),
    )
    lane: str | None = Field(
        default=None, pattern=NAME, description="Force a lane (by name) instead of routing."
    )
    budget: Budget | None = Field(default=None, description="Per-run limits (default: roster).")
    idempotency_key: str | None = Field(
        default=None, max_length=200, description="Same key again returns the existing run."
    )
    max_parallel: Annotated[int, Field(ge=1, le=1024), Whole] | None = None
    barrier: bool = Field(
        default=False,
        description="Run the plan strictly wave by wave instead of as soon as needs are done.",
    )
    wait: bool = Field(default=False, description="Wait for the answer (up to timeout_s).")
    timeout_s: float = Field(default=120.0, gt=0, le=3600, description="How long to wait.")
    tier: str | None = Field(
        default=None,
        pattern=NAME,
        description="Start every task on this tier (it still climbs the ladder from there) "
        "instead of each lane's own tier. One of the roster's tiers.",
    )
    member: str | None = Field(
        default=None,
        pattern=NAME,
        description="Send every task's model call to this roster member (no climbing).",
    )
    workspace: str | None = Field(
        default=None,
        min_length=1,
        max_length=4096,
        description=(
            "A project directory on the daemon's machine, inside a root the operator allowed. "
            "Tasks work on copies of it; its files change only through run_apply. Needs the "
            "command scope."
        ),
    )


def _commands(plan: Plan | dict[str, Any] | None) -> bool:
    """Whether a plan (a model, or the dict a run view keeps) has a command or agent task."""
    if plan is None:
        return False
    tasks = plan.tasks if isinstance(plan, Plan) else plan.get("tasks") or []
    return any(  # an agent task runs commands too (its `run` tool)
        (t.executor if isinstance(t, Task) else t.get("executor")) in ("command", "agent")
        for t in tasks
    ) or any(_checks_run(t) for t in tasks)


def _checks_run(task: Task | dict[str, Any]) -> bool:
    """Whether a task has a `run` check (it executes a command in the sandbox)."""
    found = task.assertions if isinstance(task, Task) else task.get("assertions") or []
    return any((a.type if not isinstance(a, dict) else a.get("type")) == "run" for a in found)


async def submit(daemon: Daemon, data: SubmitIn, ctx: ToolContext) -> RunOut:
    _refuse_a_bad_plan(daemon, data._unchecked)
    if _commands(data.plan):
        require(ctx, "command", "a plan with command tasks or run checks")
    if data.workspace is not None:
        require(ctx, "command", "a run on a workspace")
    await daemon.gateway.admit(ctx.client, "submit")  # the client's rpm and token budgets
    view = await daemon.engine.submit(
        data.request,
        plan=data.plan,
        lane=data.lane,
        budget=data.budget,
        idempotency_key=data.idempotency_key,
        max_parallel=data.max_parallel,
        barrier=data.barrier,
        client=ctx.client.name,
        tier=data.tier,
        member=data.member,
        workspace=data.workspace,
    )
    if not data.wait:
        return run_out(daemon.engine.shown(view))
    run_id = view.id
    try:
        async with asyncio.timeout(data.timeout_s):
            return run_out(await daemon.engine.wait(run_id))
    except (TimeoutError, DeadlineExceeded):
        return run_out(daemon.engine.shown(daemon.engine.get(run_id)))


SUBMIT = Tool(
    "submit",
    "Run a request through tally's agent fleet (route → plan → run tasks on local "
    "models → validate → answer); every step is recorded in the verifiable ledger. "
    "Returns the run (id, state); with wait=true waits up to timeout_s and returns the "
    "answer. Use it to get work done; then run_get to poll a run that is still going.",
    SubmitIn,
    RunOut,
    submit,
    scope="submit",
    errors=(NotFound, Conflict, Busy, RateLimited, Unavailable),
)


async def run_get(daemon: Daemon, data: RunIdIn, ctx: ToolContext) -> RunOut:
    # An old finished run keeps a summary in memory, or nothing; its record has the rest.
    return run_out(daemon.engine.shown(await daemon.engine.find(data.run_id)))


RUN_GET = Tool(
    "run_get",
    "Get one run by id: state, tasks, spending, and the answer once it is done. Use it "
    "to poll a run started by submit.",
    RunIdIn,
    RunOut,
    run_get,
    errors=(NotFound,),
)


class RunsIn(_In):
    state: RunState | None = Field(default=None, description="Only runs in this state.")
    limit: Annotated[int, Field(ge=1, le=1000), Whole] = 50
    all: bool = Field(
        default=False,
        description="Also the runs of the other daemons sharing this daemon's record (a record "
        "on PostgreSQL), read from the record; `daemons` names who owns each.",
    )


class RunsOut(_Out):
    runs: list[RunOut]
    daemons: dict[str, str] = Field(
        default_factory=dict,
        description="With `all`: each run's daemon (its checkpoint key's name in the record).",
    )


async def runs_list(daemon: Daemon, data: RunsIn, ctx: ToolContext) -> RunsOut:
    ours = daemon.engine.shown_list(state=data.state, limit=data.limit)
    foreign = getattr(daemon.ledger, "foreign_runs", None)
    if not data.all or foreign is None:
        return RunsOut(runs=[run_out(v) for v in ours])
    # Runs stay per daemon: the others' are read from the shared record as it stands.
    name = getattr(daemon.ledger, "name", "")
    views = [(v, name) for v in ours]
    for run_id, owner in await foreign(data.limit):
        view = (await replay(daemon.ledger, run=run_id)).get(run_id)
        if view is not None and (data.state is None or view.state == data.state):
            views.append((view, owner))
    views.sort(key=lambda p: (p[0].created_at_us, p[0].id), reverse=True)
    views = views[: data.limit]
    return RunsOut(runs=[run_out(v) for v, _ in views], daemons={v.id: o for v, o in views})


RUNS_LIST = Tool(
    "runs_list",
    "List recent runs, newest first, optionally only those in one state (e.g. running, "
    "interrupted). Use it to find a run id or see what tally is doing.",
    RunsIn,
    RunsOut,
    runs_list,
    errors=(),
)


async def run_cancel(daemon: Daemon, data: RunIdIn, ctx: ToolContext) -> RunOut:
    return run_out(await daemon.engine.cancel(data.run_id))


RUN_CANCEL = Tool(
    "run_cancel",
    "Cancel a run: in-flight model requests are aborted and no further task starts. "
    "Use it when a run is no longer wanted or is taking too long.",
    RunIdIn,
    RunOut,
    run_cancel,
    scope="submit",
    errors=(NotFound, Unavailable),
)


async def run_resume(daemon: Daemon, data: RunIdIn, ctx: ToolContext) -> RunOut:
    if _commands(daemon.engine.get(data.run_id).plan):
        require(ctx, "command", "resuming a run with command tasks")
    if daemon.engine.get(data.run_id).workspace is not None:
        require(ctx, "command", "resuming a run on a workspace")
    return run_out(daemon.engine.shown(await daemon.engine.resume(data.run_id)))


RUN_RESUME = Tool(
    "run_resume",
    "Resume an interrupted run (e.g. after a daemon restart), reusing every task "
    "already witnessed as done. Use it on runs in state 'interrupted'.",
    RunIdIn,
    RunOut,
    run_resume,
    scope="submit",
    errors=(NotFound, Conflict, Unavailable),
)


async def run_retry(daemon: Daemon, data: RunIdIn, ctx: ToolContext) -> RunOut:
    original = await daemon.engine.find(data.run_id)
    if _commands(original.plan):
        require(ctx, "command", "retrying a run with command tasks")
    if original.workspace is not None:
        require(ctx, "command", "retrying a run on a workspace")
    return run_out(
        daemon.engine.shown(await daemon.engine.retry(data.run_id, client=ctx.client.name))
    )


RUN_RETRY = Tool(
    "run_retry",
    "Retry a failed, cancelled or budget-exhausted run: a new run with the same "
    "request, plan and budget whose record links the original (retry_of); the tasks "
    "the original had done are reused, not run again, and the rest run anew. On a "
    "workspace (command scope) it works on a fresh snapshot of it, onto which each "
    "reused task's changes are carried (a task whose changes no longer apply runs "
    "again: `workspace.carry` says why). Returns the new run.",
    RunIdIn,
    RunOut,
    run_retry,
    scope="submit",
    errors=(NotFound, Conflict, Busy, Unavailable),
)


class PatchOut(_Out):
    """A run's combined patch: its done tasks' changes to the workspace, a unified diff."""

    run_id: str
    workspace: str | None = None
    state: RunState
    patch: str | None = Field(
        default=None, description="The unified diff (None: the run has no patch yet)."
    )
    files: list[str] = Field(default=[])
    tasks: list[str] = Field(default=[], description="The tasks whose changes it holds.")
    seq: int | None = Field(default=None, description="The run.patch entry.")
    error: str | None = None


async def run_patch(daemon: Daemon, data: RunIdIn, ctx: ToolContext) -> PatchOut:
    view, body = await daemon.engine.patch(data.run_id)
    out = PatchOut(run_id=view.id, workspace=view.workspace, state=view.state, seq=view.patch_seq)
    if body is not None:
        out.patch, out.files, out.tasks, out.error = body.patch, body.files, body.tasks, body.error
    return out


RUN_PATCH = Tool(
    "run_patch",
    "Get a workspace run's combined patch: the unified diff of every done task's "
    "changes to its copy of the project, against the snapshot taken at submit. Nothing "
    "is written; use run_apply to apply it.",
    RunIdIn,
    PatchOut,
    run_patch,
    errors=(NotFound, Conflict),
)


class ApplyIn(RunIdIn):
    check: bool = Field(
        default=False, description="Only check that it applies: nothing is written or witnessed."
    )


class ApplyOut(_Out):
    run_id: str
    workspace: str
    applied: bool = Field(description="Whether the files were changed (false with check).")
    method: str = Field(description="git-3way, git-apply, or none (nothing to do).")
    files: list[str]
    note: str | None = None


async def run_apply(daemon: Daemon, data: ApplyIn, ctx: ToolContext) -> ApplyOut:
    done = await daemon.engine.apply(data.run_id, check=data.check, client=ctx.client.name)
    return ApplyOut(
        run_id=data.run_id,
        workspace=done.path,
        applied=not data.check and done.method != "none",
        method=done.method,
        files=done.files,
        note=done.error,
    )


RUN_APPLY = Tool(
    "run_apply",
    "Apply a workspace run's patch to the project (check=true only tries). Refuses "
    "paths outside the workspace and files changed since the run's snapshot; a git "
    "repository gets `git apply --3way`. Witnessed in the ledger.",
    ApplyIn,
    ApplyOut,
    run_apply,
    scope="command",
    errors=(NotFound, Conflict, Unavailable),
)


class ReplayIn(RunIdIn):
    at: Seq | None = Field(
        default=None, description="The ledger seq to stop at (inclusive); default: the end."
    )


async def run_replay(daemon: Daemon, data: ReplayIn, ctx: ToolContext) -> RunOut:
    view = (await replay(daemon.ledger, run=data.run_id, until=data.at)).get(data.run_id)
    if view is None:
        where = "" if data.at is None else f" at seq {data.at}"
        raise NotFound(f"no run {data.run_id}{where}", details={"run": data.run_id})
    return run_out(view)


RUN_REPLAY = Tool(
    "run_replay",
    "Rebuild a run's state from the ledger alone as it stood after entry `at` (default: "
    "now), without calling any model: model replies are in the record. Use it to see "
    "what a run looked like at a point in its history.",
    ReplayIn,
    RunOut,
    run_replay,
    errors=(NotFound,),
)


class CompareIn(_In):
    a: str = Field(min_length=1, max_length=128, description="One run's id.")
    b: str = Field(min_length=1, max_length=128, description="The other run's id.")


class CompareSide(_Out):
    id: str
    state: RunState
    lane: str | None = None
    request: str
    tasks: int
    model_calls: int
    tokens: int
    wall_ms: int
    escalations: int = Field(description="task.escalate entries.")
    verdicts_ok: int
    verdicts_failed: int
    answer: str | None = None


class CompareOut(_Out):
    a: CompareSide
    b: CompareSide


async def _compare_side(daemon: Daemon, run_id: str) -> CompareSide:
    daemon.engine.get(run_id)  # NotFound for a run the daemon does not know
    view = (await replay(daemon.ledger, run=run_id)).get(run_id)
    if view is None:
        raise NotFound(f"no run {run_id}", details={"run": run_id})
    counts = {k.TASK_ESCALATE: 0, "ok": 0, "failed": 0}
    start = view.request_seq
    while True:
        batch = await daemon.ledger.entries(start=start, limit=1000, run=run_id)
        verdicts = [e.body if e.kind == k.TASK_VERDICT else None for e in batch]
        for e, (_, body) in zip(batch, await daemon.ledger.read_bodies(verdicts), strict=True):
            if e.kind == k.TASK_ESCALATE:
                counts[k.TASK_ESCALATE] += 1
            elif e.kind == k.TASK_VERDICT and e.body is not None:
                verdict = rec.TaskVerdict.parsed(body)
                counts["ok" if verdict is not None and verdict.ok else "failed"] += 1
        if len(batch) < 1000:
            break
        start = batch[-1].seq + 1
    return CompareSide(
        id=view.id,
        state=view.state,
        lane=view.lane,
        request=view.request,
        tasks=len(view.tasks),
        model_calls=view.spent.model_calls,
        tokens=view.spent.tokens,
        wall_ms=view.spent.wall_ms,
        escalations=counts[k.TASK_ESCALATE],
        verdicts_ok=counts["ok"],
        verdicts_failed=counts["failed"],
        answer=view.answer,
    )


async def run_compare(daemon: Daemon, data: CompareIn, ctx: ToolContext) -> CompareOut:
    return CompareOut(a=await _compare_side(daemon, data.a), b=await _compare_side(daemon, data.b))


RUN_COMPARE = Tool(
    "run_compare",
    "Compare two runs side by side from the record: state, tasks, model calls, tokens, "
    "wall time, escalations, verdicts and answers. Use it to show that a change to a "
    "roster, model or prompt helped.",
    CompareIn,
    CompareOut,
    run_compare,
    errors=(NotFound,),
)
