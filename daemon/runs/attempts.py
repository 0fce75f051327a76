"""A task's attempts: one task driven up the escalation ladder until a verdict passes.

Input: a planned run and one of its tasks whose needs are done (their outputs in
`run.outputs`). Each attempt on a rung is witnessed as
`task.start` (parent: the plan, the last need's verdict, or the escalation) → the executor's
own entries (`model.call`/`model.reply` for chat, `command.run` for a command, one
`agent.step` per step for an agent (see `daemon.runs.agent.executor`), none for an injected stub)
→ `task.result` (parent: the executor's last entry; output cut to RESULT_CAP, or the
executor's error) → `task.verdict` (parent: the result) with the failed assertions and the
judge's verdict, and `next`. An attempt with a view (see `views`) witnesses its diff and its
`run` checks between the result and the verdict. A failed verdict is retried on the same rung
(`next` "retry", up to `[policy] attempts_per_rung` attempts there), then followed by
`task.escalate` (parent: the verdict); the next attempt carries the failures (a failed check's
own output included) as feedback.
Command tasks never climb (a tier does not change a command).
Guarantees: no attempt starts once the run is cancelling; an executor's error is a failed
attempt, never a crash of the run, while budget exhaustion and cancellation propagate; the
judge (a model call) is asked only about chat output that already passes its assertions, and
an unavailable judge passes the task. Returns True (done; output in `run.outputs`) or False.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from daemon import record as rec
from daemon.errors import InvalidInput
from daemon.plans import Plan, Task
from daemon.runs import agentcli, checks, guard, views
from daemon.runs.agent import executor as agent_executor
from daemon.runs.agent.executor import AgentStopped
from daemon.runs.budget import BudgetExhausted
from daemon.runs.calls import call, structured
from daemon.runs.context import Run, Setting, TaskFailed, describe
from daemon.runs.executors import chat_messages, clip, run_command
from daemon.runs.limits import LimitExceeded
from daemon.runs.sandbox import admit_commands
from daemon.workspace.view import View
from roster.models import Lane

RESULT_CAP = 64 * 1024
"""A task output kept in the record and in memory is cut to this many characters."""


async def execute(s: Setting, run: Run, task: Task) -> bool:
    """Run a task up the escalation ladder until a verdict passes or no rung is left."""
    view = s.views[run.id]
    lane = s.lanes.get(task.lane)
    if lane is None:
        raise TaskFailed(f"task {task.id}: no lane {task.lane!r} in the roster")
    ladder, rung = _ladder(s, view.tier, view.member, lane)
    needs_seqs = [
        t.verdict_seq for n in task.needs if (t := view.task(n)) and t.verdict_seq is not None
    ]
    parent = max(needs_seqs) if needs_seqs else view.plan_seq or view.request_seq
    state = view.task(task.id)
    attempt = state.attempts if state is not None else 0
    feedback: list[str] = []
    previous: str | None = None
    per_rung = s.roster.policy.attempts_per_rung
    on_rung = 0
    while True:
        if run.cancelling:
            raise asyncio.CancelledError
        attempt += 1
        on_rung += 1
        tier = ladder[rung] if task.executor != "command" else None
        output, exit_code, error, result_seq, opened = await _attempt(
            s, run, task, lane, tier, attempt, feedback, previous, parent
        )
        found: list[str] = []
        if opened is not None:  # its output into the view, its changes, its `run` checks
            # An agent CLI edited the view itself: its stdout is no edit to apply.
            cli = task.executor == "chat" and bool(agentcli.member_for(s.roster, tier or ""))
            found, result_seq = await views.settle(
                s, run, task, lane, attempt, opened, output, error, result_seq, applied=cli
            )
        failures, judged = await _assess(s, run, task, output, exit_code, error, result_seq, found)
        # Informed retry: the same rung again with the failures as feedback, then a climb.
        can_retry = task.executor != "command" and on_rung < per_rung
        can_climb = task.executor != "command" and rung + 1 < len(ladder)
        nxt = (
            "done"
            if not failures
            else "retry"
            if can_retry
            else ("escalate" if can_climb else "failed")
        )
        verdict_seq = await s.witness(
            run.id,
            rec.TaskVerdict(
                task=task.id,
                attempt=attempt,
                ok=not failures,
                failures=failures,
                judge=None if judged is None else rec.Judge.model_validate(judged),
                next=nxt,
            ),
            result_seq,
        )
        if nxt == "done":
            run.outputs[task.id] = output
            return True
        if nxt == "failed":
            return False
        if nxt == "retry":
            parent = verdict_seq
            feedback, previous = failures, output
            continue
        parent = await s.witness(
            run.id,
            rec.TaskEscalate(
                task=task.id,
                from_tier=tier,
                to_tier=ladder[rung + 1],
                reason=failures[0],
                failures=failures,
            ),
            verdict_seq,
        )
        rung += 1
        on_rung = 0
        feedback, previous = failures, output


async def _attempt(
    s: Setting,
    run: Run,
    task: Task,
    lane: Lane,
    tier: str | None,
    attempt: int,
    feedback: list[str],
    previous: str | None,
    parent: int,
) -> tuple[str, int | None, str | None, int, View | None]:
    """One try on one rung, witnessed start and result: (output, exit code, error, seq, the
    attempt's view if it has one)."""
    start_seq = await s.witness(
        run.id,
        rec.TaskStart(
            task=task.id,
            lane=task.lane,
            executor=task.executor,
            tier=tier,
            attempt=attempt,
            needs=list(task.needs),
            feedback=feedback,
        ),
        parent,
    )
    upstream = {n: run.outputs.get(n, "") for n in task.needs}
    output, exit_code, error = "", None, None
    result_parent = start_seq
    # A view that cannot be made (the workspace changed under a resumed run, upstream changes
    # that conflict) is no attempt's fault and no retry mends it: it fails the run.
    opened = await views.open_view(s, run, task, attempt)
    try:
        output, exit_code, result_parent = await _run_executor(
            s, run, task, lane, tier, attempt, upstream, feedback, previous, start_seq, opened
        )
    except (BudgetExhausted, asyncio.CancelledError):
        raise
    except AgentStopped as exc:  # a failed attempt whose result follows its last step
        error, result_parent = describe(exc), exc.seq
    except Exception as exc:  # an executor error is a failed attempt, not a crash
        error = describe(exc)
    output = clip(output, RESULT_CAP)
    result_seq = await s.witness(
        run.id,
        rec.TaskResult(
            task=task.id,
            attempt=attempt,
            ok=error is None,
            output=output,
            exit_code=exit_code,
            error=error,
        ),
        result_parent,
    )
    return output, exit_code, error, result_seq, opened


async def _assess(
    s: Setting,
    run: Run,
    task: Task,
    output: str,
    exit_code: int | None,
    error: str | None,
    result_seq: int,
    found: list[str],
) -> tuple[list[str], dict[str, Any] | None]:
    """Why the attempt fails (empty: it passes), and the judge's verdict if one was asked.
    `found`: what its view found (edits that do not apply, failed `run` checks)."""
    if error is not None:
        return [f"the executor failed: {error}"], None
    failures = [*found, *checks.check(task.assertions, output, exit_code)]
    # The judge costs a model call, so only output that already passes its assertions gets one.
    if failures or not s.judge or task.executor != "chat":
        return failures, None
    judged = await _judge(s, run, task, output, result_seq)
    if not judged["ok"]:
        failures.append(f"the judge found: {judged['reason']}")
    return failures, judged


async def _run_executor(
    s: Setting,
    run: Run,
    task: Task,
    lane: Lane,
    tier: str | None,
    attempt: int,
    upstream: Mapping[str, str],
    feedback: list[str],
    previous: str | None,
    start_seq: int,
    opened: View | None = None,
) -> tuple[str, int | None, int]:
    """(output, exit code, the seq the result hangs off) of the task's executor."""
    if task.executor == "command":
        return await _run_command(s, run, task, start_seq, opened)
    if s.stub is not None and task.executor == "chat":  # a test's or benchmark's model
        return await s.stub(task.id, task.instruction, attempt, upstream), None, start_seq
    # An agent-cli tier runs its CLI for chat and agent tasks alike: the CLI is the agent.
    if clis := agentcli.member_for(s.roster, tier or lane.tier):  # see daemon.runs.agentcli
        return await agentcli.run(
            s, run, task, clis, attempt, upstream, feedback, previous, start_seq, opened
        )
    if task.executor == "agent":
        output, last = await agent_executor.run(
            s,
            run,
            task,
            lane,
            tier or lane.tier,
            dict(upstream),
            feedback,
            previous,
            start_seq,
            opened,
        )
        return output, None, last
    rest = len(lane.system) + sum(min(len(v), 4000) for v in upstream.values())
    rest += sum(len(f) for f in feedback) + 1600
    text = views.instruction(s, run, task, lane, tier, opened, rest)
    messages = chat_messages(lane.system, text, upstream, feedback, previous)
    result, reply_seq = await call(
        s,
        run,
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


async def _run_command(
    s: Setting, run: Run, task: Task, start_seq: int, opened: View | None = None
) -> tuple[str, int | None, int]:
    if not task.argv:
        raise InvalidInput(f"task {task.id}: a command task needs argv")
    policy = s.roster.policy.command
    admit_commands(
        Plan(tasks=[task]), policy, s.options.confinement.hidden
    )  # the roster may have changed since
    outcome = await run_command(
        task.argv,
        policy=policy,
        confinement=s.options.confinement,
        network=task.network,
        timeout_s=min(task.timeout_s or s.options.command_timeout_s, policy.max_timeout_s),
        workdir=opened.path if opened is not None else None,
    )
    seq = await s.witness(run.id, outcome.body(task.id), start_seq)
    if outcome.timed_out:
        raise TimeoutError(f"the command timed out after {outcome.duration_ms} ms")
    if outcome.limit is not None:
        raise LimitExceeded(outcome.limit)
    return outcome.stdout, outcome.exit_code, seq


async def _judge(s: Setting, run: Run, task: Task, output: str, parent: int) -> dict[str, Any]:
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
        got = await structured(s, run, "judge", s.judge or "", messages, schema, valid, parent)
    except (BudgetExhausted, asyncio.CancelledError):
        raise
    except Exception as exc:  # an unavailable judge does not fail a task
        return {"ok": True, "reason": f"no judgement: {describe(exc)}"}
    value: dict[str, Any] = got.value
    return value


def _ladder(s: Setting, tier: str | None, member: str | None, lane: Lane) -> tuple[list[str], int]:
    """The targets a task climbs and the rung it starts on: the lane's tier on the roster's
    ladder, unless the run's client chose a tier (from there up; alone if it is not on the
    ladder) or a member (that member only: a member has no ladder)."""
    ladder = list(s.roster.tiers.ladder)
    if member is not None:
        return [member], 0
    start = tier if tier is not None else lane.tier
    if start in ladder:
        return ladder, ladder.index(start)
    return ([start], 0) if tier is not None else (ladder, 0)


def _constrained(task: Task) -> dict[str, Any] | None:
    """A task whose output must match a JSON schema asks the server for exactly that
    (constrained decoding); the assertion still checks it, and a failure still escalates."""
    for assertion in task.assertions:
        if assertion.type == "json_schema":
            return guard.response_format("task_output", assertion.json_schema)
    return None
