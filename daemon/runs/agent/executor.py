"""The `agent` executor as the engine runs it: one attempt of a task with `"executor": "agent"`.

`attempts` calls `run` with the attempt's view open; the loop (`loop.run_agent`) then runs on
it with what the engine gives every task:
- the slot: each step leases from the pool through the run's waits (the task shows `waiting`
  while it queues), on the attempt's rung of the escalation ladder, with an affinity of the
  run and task, so the same slot and its prompt cache come back step after step;
- the budget: each step reserves a model call against the run's budget (`Meter.reserve_call`,
  which also stops at the token limit: each witnessed step adds its tokens to the run's view);
- the sandbox and limits: the `run` tool is the command executor's sandbox (bubblewrap, the
  roster's rlimits, quota, no network) with the view as its only writable dir and the task's
  timeout (none of it when the roster's command executor is off or not for this lane: then
  `run` is refused and says why); the tools never read what the workspace policy hides;
- the checks: `finish` is accepted once the task's `run` checks and the lane's checks pass in
  the view (the output of failing ones is the model's next observation); `views.settle` runs
  them again afterwards and witnesses them, as for any task;
- informed retry: the instruction carries the upstream results and, on a retry or a climb,
  the previous attempt's failures, as a chat task's prompt does.

Witnessed: an `agent.step` per step (parent: the previous step, the first: `task.start`).
The task's output is the accepted `finish` summary; its changes are the view's (`task.diff`).
A loop that ends without an accepted finish (stuck, out of steps, malformed replies, the
context full, its wall time) is a failed attempt (`AgentStopped`), whose result hangs off its
last step.
"""

from __future__ import annotations

import functools
from pathlib import Path

from daemon.plans import Task
from daemon.runs import views
from daemon.runs.agent.calls import Mode
from daemon.runs.agent.loop import AgentLimits, AgentResult, LeaseFactory, run_agent, sandboxed
from daemon.runs.agent.paths import DEFAULT_HIDDEN
from daemon.runs.context import Run, Setting
from daemon.runs.executors import chat_messages, clip, run_command
from daemon.workspace.view import View
from roster.models import Lane

DEFAULT_STEPS = 30
DEFAULT_WALL_S = 600.0
STEP_TOKENS = 768
"""A step's completion tokens: one tool call (a `write_file` of a small file fits)."""
CHECK_OUTPUT = 6000


class AgentStopped(Exception):
    """The loop ended without an accepted `finish`; `seq` is its last step (the result's
    parent), `outcome` the guardrail that ended it."""

    def __init__(self, result: AgentResult, fallback: int) -> None:
        self.outcome = result.outcome
        self.seq = result.last_seq if result.last_seq is not None else fallback
        super().__init__(
            f"the agent stopped ({result.outcome}) after {result.steps} steps: {result.error}"
        )


def mode_of(lane: Lane) -> Mode:
    """The lane's way of asking for tool calls: "native" if it says so, else JSON (which every
    llama.cpp server follows, the embedded model included)."""
    return "native" if lane.agent == "native" else "json"


async def run(
    s: Setting,
    run: Run,
    task: Task,
    lane: Lane,
    target: str,
    upstream: dict[str, str],
    feedback: list[str],
    previous: str | None,
    start_seq: int,
    opened: View | None,
) -> tuple[str, int]:
    """One attempt: (the finish summary, the last step's seq). Raises `AgentStopped`."""
    if opened is None:  # submit refuses such plans (`agent_needs_view`); a resumed old one
        raise ValueError(f"task {task.id}: an agent task needs a workspace or files to work on")
    policy = s.roster.policy.command
    timeout_s = min(task.timeout_s or s.options.command_timeout_s, policy.max_timeout_s)
    allowed = policy.enabled and (policy.lanes is None or task.lane in policy.lanes)
    runner = (
        sandboxed(
            opened.path, policy=policy, confinement=s.options.confinement, timeout_s=timeout_s
        )
        if allowed
        else None
    )
    found = views.checks_of(s, run, task, lane, opened)

    async def checks() -> tuple[bool, str]:
        said: list[str] = []
        for argv, check_timeout, _ in found:
            outcome = await run_command(
                argv,
                policy=policy,
                confinement=s.options.confinement,
                timeout_s=min(check_timeout, policy.max_timeout_s),
                workdir=opened.path,
            )
            shown = " ".join(argv)
            how = "timed out" if outcome.timed_out else f"exit {outcome.exit_code}"
            said.append(f"$ {shown}  ({how})\n{(outcome.stdout + outcome.stderr).strip()}")
            if outcome.exit_code != 0 or outcome.timed_out:
                return False, clip("\n\n".join(said), CHECK_OUTPUT)
        return True, clip("\n\n".join(said), CHECK_OUTPUT)

    n_ctx = _window(s, target)
    limits = AgentLimits(
        max_steps=task.max_steps or DEFAULT_STEPS,
        wall_s=task.timeout_s or DEFAULT_WALL_S,
        n_ctx=n_ctx,
        step_tokens=min(STEP_TOKENS, max(128, n_ctx // 4)),
    )
    affinity = f"agent:{run.id}:{task.id}"
    lease: LeaseFactory = lambda: s.waits.lease(  # noqa: E731 - a factory the loop calls per step
        run.id, task.id, s.pool.lease(target, priority=1, affinity=affinity)
    )
    # The instruction as a chat task's prompt says it: upstream results, then the failures of
    # the attempt before (informed retry).
    instruction = str(
        chat_messages("", task.instruction, upstream, feedback, previous)[1]["content"]
    )
    result = await run_agent(
        instruction,
        Path(opened.path),
        lease,
        functools.partial(s.witness, run.id),
        checks=checks if found else None,
        limits=limits,
        runner=runner,
        mode=mode_of(lane),
        system=lane.system,
        hidden=(*DEFAULT_HIDDEN, *s.roster.policy.workspace.hide),
        task=task.id,
        parent=start_seq,
        reserve=run.meter.reserve_call,
    )
    if result.outcome != "finished":
        raise AgentStopped(result, start_seq)
    return result.summary or "", result.last_seq if result.last_seq is not None else start_seq


def _window(s: Setting, target: str) -> int:
    """The smallest context window (tokens) among the target's members: as each running
    instance reported it in `/props`, else the roster's `ctx`, else 4096."""
    names = set(s.roster.tiers.members.get(target, [target]))
    windows: list[int] = []
    status = getattr(s.pool, "status", None)  # the slot pool has it; the engine's port not
    if callable(status):
        for member in status().members:
            if member.name in names:
                windows += [i.n_ctx for i in member.instances if isinstance(i.n_ctx, int)]
    if not windows:
        windows = [m.ctx for m in s.roster.models if m.name in names] or [4096]
    return max(512, min(windows))
