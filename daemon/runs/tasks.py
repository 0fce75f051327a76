"""A run's tasks: every task of its plan dispatched, each up its ladder (`attempts.execute`).

Input: a run whose plan is witnessed; tasks already done (a resumed run's, in
`run.outputs`) are not run again. Dispatch is dependency-driven (`dispatch.dispatch`): bounded
by the run's `max_parallel` (else the roster's), the daemon-wide `Capacity` and the lanes'
caps, in waves only with `barrier`. Witnessed here: `task.skip` (parent: the plan) for each
task a failed dependency leaves out (policy `on_task_failure = "continue"`); the attempts
witness the rest.
Guarantees: returns only if the run can be answered — with `on_task_failure = "fail"` any
failed task, otherwise no task done at all, raises `TaskFailed` naming the failed tasks and
their errors.
"""

from __future__ import annotations

from daemon import record as rec
from daemon.plans import Plan
from daemon.runs import attempts
from daemon.runs.context import Run, Setting, TaskFailed
from daemon.runs.dispatch import Node, dispatch


async def run_plan(s: Setting, run: Run, plan: Plan) -> None:
    view = s.views[run.id]
    by_id = {t.id: t for t in plan.tasks}
    nodes = [Node(t.id, t.lane, tuple(t.needs)) for t in plan.tasks]
    policy = s.roster.policy

    async def execute(task_id: str) -> bool:
        return await attempts.execute(s, run, by_id[task_id])

    async def skip(task_id: str, reason: str) -> None:
        await s.witness(run.id, rec.TaskSkip(task=task_id, reason=reason), view.plan_seq)

    outcome = await dispatch(
        nodes,
        execute,
        max_parallel=view.max_parallel or policy.max_parallel,
        capacity=s.capacity,
        barrier=view.barrier,
        done=set(run.outputs),
        stop_on_failure=policy.on_task_failure == "fail",
        on_skip=skip,
        on_hold=lambda held: s.waits.hold(run.id, held),
    )
    if outcome.failed and (policy.on_task_failure == "fail" or not outcome.done):
        failed = sorted(outcome.failed)
        errors = [f"{t}: {(view.task(t) or view.tasks[0]).error}" for t in failed]
        raise TaskFailed("task failed: " + "; ".join(errors))
