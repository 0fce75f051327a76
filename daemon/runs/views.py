"""A run's workspace as its steps use it: the snapshot at submit, a view per attempt, the
checks that run the work in it, and the run's combined patch (see `daemon.workspace`).

Witnessed here (bodies in `daemon.workspace.record`): `workspace.snapshot` is the engine's
(at submit); per attempt with a view, `task.diff` (parent: the result; workspace runs only),
then one `check.run` per `run` check (each hangs off the previous entry), and the verdict
hangs off the last; `run.patch` (parent: the last verdict) once the tasks are done.

An attempt gets a view when its run has a workspace, or the task has `files`, an
`output_file` or a `run` check (then an empty dir). The view is the snapshot plus the changes
of every task it needs, transitively, in plan order; the task's `files` are written into it,
the executor runs in it (a command with the view as its working dir; a chat task's answer
parsed as edits, or written to `output_file`), its changes are captured, then its checks run
in the sandbox there. Lane checks (`[[lanes]] checks`) apply in a workspace only. A run
resumed after a restart takes its snapshot again and refuses to go on if the workspace's
visible files are not the ones witnessed.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TypeVar

from daemon import record as rec
from daemon.errors import InvalidInput
from daemon.plans import Plan, RunAssertion, Task
from daemon.runs.context import Run, Setting
from daemon.runs.executors import run_command
from daemon.runs.sandbox import bwrap_path
from daemon.runs.state import RunView
from daemon.workspace import context, edits, suites
from daemon.workspace import record as ws
from daemon.workspace.paths import PathRefused, check_relative, join
from daemon.workspace.snapshot import allowed, take
from daemon.workspace.view import RunDirs, View, ViewFailed
from roster.models import CommandPolicy, Lane

B = TypeVar("B", bound=rec.Body)

TAIL = 4000
"""A check's stdout and stderr are witnessed as their last this-many characters…"""
FEEDBACK_TAIL = 2500
"""…and its failure, as feedback for the next attempt, carries this much of them."""
_FENCED = re.compile(r"^(`{3,}|~{3,})[^\n]*\n(.*?)^\1\s*$", re.S | re.M)
_OPEN_FENCE = re.compile(r"^(`{3,}|~{3,})[^\n]*\n(.*)\Z", re.S | re.M)


def roots(s: Setting) -> list[Path]:
    configured = [*s.roster.policy.workspace.roots, *map(str, s.options.workspace_roots)]
    return [Path(os.path.realpath(root)) for root in configured]


async def snapshot(s: Setting, run_id: str, path: str) -> tuple[RunDirs, ws.SnapshotBody]:
    """Check the workspace is allowed and copy what tasks may see of it (off the loop)."""
    policy = s.roster.policy.workspace
    real = allowed(path, roots(s), s.options.confinement.hidden)
    space = RunDirs(s.options.confinement.tasks_root, run_id)

    def work() -> ws.SnapshotBody:
        try:
            space.prepare(policy.hide)
            return take(real, policy, space.base)
        except BaseException:
            space.remove()
            raise

    return space, await asyncio.to_thread(work)


def admit(plan: Plan, policy: CommandPolicy) -> None:
    """Refuse at submit a plan whose `run` checks this roster cannot run."""
    checked = [t.id for t in plan.tasks if any(a.type == "run" for a in t.assertions)]
    if not checked:
        return
    if not policy.enabled:
        raise InvalidInput(
            "`run` checks execute commands, and the command executor is off in this roster "
            "([policy.command] enabled = false)",
            details={"tasks": checked},
        )
    if policy.sandbox == "bwrap":
        bwrap_path()


def wants_view(view: RunView, task: Task) -> bool:
    return (
        view.workspace is not None
        or bool(task.files)
        or task.output_file is not None
        or any(a.type == "run" for a in task.assertions)
    )


async def open_view(s: Setting, run: Run, task: Task, attempt: int) -> View | None:
    """The attempt's view, or None when the task needs none."""
    view = s.views[run.id]
    if not wants_view(view, task):
        return None
    if view.workspace is not None and (run.space is None or not run.space.has_base()):
        await _restore(s, run, view)
    if run.space is None:
        run.space = RunDirs(s.options.confinement.tasks_root, run.id)
    space = run.space
    upstream = []
    if view.workspace is not None:
        upstream = [await diff_of(s, run, need) for need in ancestors(view, task.id)]
    name = "v-" + hashlib.sha256(task.id.encode()).hexdigest()[:16] + f".{attempt}"

    def work() -> View:
        space.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        opened = space.open(name, upstream, workspace=view.workspace is not None)
        for path, content in task.files.items():
            target = join(opened.path, check_relative(path))
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(content)
        return opened

    return await asyncio.to_thread(work)


def instruction(
    s: Setting, run: Run, task: Task, lane: Lane, tier: str | None, opened: View | None, fixed: int
) -> str:
    """The task's instruction, with its workspace and the answer's form when it has a view.

    `fixed` is the length of the rest of the prompt (system, upstream results, feedback)."""
    if opened is None:
        return task.instruction
    view = s.views[run.id]
    parts = [task.instruction]
    if view.workspace is not None:
        room = _room(s, tier or lane.tier) - fixed - len(task.instruction) - 2000
        parts.append(context.block(opened.path, task.instruction, max(room, 500)))
    if task.output_file is not None:
        parts.append(
            f"Your answer's first fenced code block is written to the file "
            f"{task.output_file}; put the complete file in it."
        )
    elif view.workspace is not None and task.executor == "chat":
        parts.append(edits.INSTRUCTIONS)
    return "\n\n".join(parts)


def _room(s: Setting, target: str) -> int:
    """Characters of prompt the target's smallest context window leaves, less the answer.

    The window is the `n_ctx` each running instance reported in `/props`, where the pool has
    read one (a pool that reports no status, or a member not started yet: the roster's `ctx`).
    """
    names = set(s.roster.tiers.members.get(target, [target]))
    windows: list[int] = []
    status = getattr(s.pool, "status", None)  # the slot pool has it; the engine's port not
    if callable(status):
        for member in status().members:
            if member.name in names:
                windows += [i.n_ctx for i in member.instances if isinstance(i.n_ctx, int)]
    if not windows:
        windows = [m.ctx for m in s.roster.models if m.name in names] or [4096]
    tokens = min(windows) - s.options.max_tokens
    return max(0, tokens) * context.CHARS_PER_TOKEN


async def settle(
    s: Setting,
    run: Run,
    task: Task,
    lane: Lane,
    attempt: int,
    opened: View,
    output: str,
    error: str | None,
    parent: int,
    applied: bool = False,
) -> tuple[list[str], int]:
    """After the executor: its output into the view, the changes captured, the checks run.
    Returns the failures (the next attempt's feedback) and the last seq witnessed.
    `applied`: the executor changed the view itself (an agent CLI); its output is no edit."""
    view = s.views[run.id]
    space = run.space
    assert space is not None
    failures: list[str] = []
    seq = parent
    try:
        if error is None and not applied:
            try:
                await asyncio.to_thread(_use_output, s, view, task, opened, output)
            except (edits.EditError, PathRefused, OSError) as exc:
                failures.append(f"the answer could not be applied to the files: {exc}")
        if view.workspace is not None:
            diff = ""
            files: list[str] = []
            why: str | None = None
            try:
                diff, files = await asyncio.to_thread(space.capture, opened)
            except ViewFailed as exc:
                why = str(exc)
                failures.append(why)
            body = rec.TaskDiff(task=task.id, attempt=attempt, diff=diff, files=files, error=why)
            seq = await s.witness(run.id, body, seq)
            run.diffs[task.id] = diff
        if error is None and not failures:
            for argv, timeout_s, source in _checks(s, view, task, lane, opened):
                failure, seq = await _check(
                    s, run, task, attempt, opened, argv, timeout_s, source, seq
                )
                if failure is not None:
                    failures.append(failure)
                    break  # the first failing check is the feedback; the rest would repeat it
    finally:
        await asyncio.to_thread(space.close, opened)
    return failures, seq


def _use_output(s: Setting, view: RunView, task: Task, opened: View, output: str) -> None:
    if task.output_file is not None:
        target = join(opened.path, check_relative(task.output_file))
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(first_code_block(output))
    elif view.workspace is not None and task.executor == "chat":
        hide = list(s.roster.policy.workspace.hide)
        edits.apply(opened.path, edits.parse(output), hide)


def first_code_block(output: str) -> str:
    """The first fenced code block's content (an unclosed one runs to the end), else all."""
    found = _FENCED.search(output) or _OPEN_FENCE.search(output)
    if found is None:
        return output
    text = found.group(2)
    return text if text.endswith("\n") or not text else text + "\n"


def checks_of(
    s: Setting, run: Run, task: Task, lane: Lane, opened: View
) -> list[tuple[list[str], float, str]]:
    """The checks `settle` runs in the attempt's view: (argv, timeout, "task" or "lane") each
    (the agent executor runs them when its model calls `finish`)."""
    return _checks(s, s.views[run.id], task, lane, opened)


def _checks(
    s: Setting, view: RunView, task: Task, lane: Lane, opened: View
) -> list[tuple[list[str], float, str]]:
    found: list[tuple[list[str], float, str]] = [
        (list(a.argv), a.timeout_s, "task") for a in task.assertions if isinstance(a, RunAssertion)
    ]
    if view.workspace is None or not s.roster.policy.command.enabled:
        return found
    for check in lane.checks:
        if check.type == "run" and check.argv is not None:
            found.append((list(check.argv), check.timeout_s, "lane"))
        elif check.type == "tests":
            found.extend((argv, check.timeout_s, "lane") for argv in suites.detect(opened.path))
    return found


async def _check(
    s: Setting,
    run: Run,
    task: Task,
    attempt: int,
    opened: View,
    argv: list[str],
    timeout_s: float,
    source: str,
    parent: int,
) -> tuple[str | None, int]:
    policy = s.roster.policy.command
    outcome = await run_command(
        argv,
        policy=policy,
        confinement=s.options.confinement,
        timeout_s=min(timeout_s, policy.max_timeout_s),
        workdir=opened.path,
    )
    body = rec.CheckRun(
        task=task.id,
        attempt=attempt,
        argv=list(argv),
        exit_code=outcome.exit_code,
        timed_out=outcome.timed_out,
        stdout_tail=_tail(outcome.stdout, TAIL),
        stderr_tail=_tail(outcome.stderr, TAIL),
        duration_ms=outcome.duration_ms,
        source="task" if source == "task" else "lane",
    )
    seq = await s.witness(run.id, body, parent)
    if outcome.exit_code == 0 and not outcome.timed_out:
        return None, seq
    shown = " ".join(argv)
    how = (
        f"timed out after {min(timeout_s, policy.max_timeout_s):g} s"
        if outcome.timed_out
        else f"exited {outcome.exit_code}"
    )
    tail = _tail((outcome.stdout + "\n" + outcome.stderr).strip(), FEEDBACK_TAIL)
    return f"the check `{shown}` failed ({how}):\n{tail}", seq


def _tail(text: str, limit: int) -> str:
    return text if len(text) <= limit else "…" + text[-(limit - 1) :]


def ancestors(view: RunView, task_id: str) -> list[str]:
    """Every task `task_id` needs, directly or not, in plan order."""
    needs: Mapping[str, Sequence[str]] = {t.id: t.needs for t in view.tasks}
    found: set[str] = set()
    stack = list(needs.get(task_id, ()))
    while stack:
        need = stack.pop()
        if need not in found:
            found.add(need)
            stack.extend(needs.get(need, ()))
    return [t.id for t in view.tasks if t.id in found]


async def diff_of(s: Setting, run: Run, task_id: str) -> str:
    """A done task's diff: in memory, or (after a restart) its last witnessed `task.diff`."""
    if task_id in run.diffs:
        return run.diffs[task_id]
    found = await last_diffs(s, run.id, s.views[run.id].request_seq, [task_id])
    run.diffs[task_id] = found.get(task_id, "")
    return run.diffs[task_id]


async def witnessed(s: Setting, run_id: str, start: int, model: type[B]) -> list[B]:
    """The bodies of a run's entries of one kind from `start` on, in order, as its model: a
    redacted body or one that does not fit is left out (it says nothing to build on)."""
    found: list[B] = []
    while True:
        batch = await s.ledger.entries(start=start, limit=500, kind=model.KIND, run=run_id)
        bodies = await s.ledger.read_bodies([entry.body for entry in batch])
        found += [read for _, value in bodies if (read := model.parsed(value)) is not None]
        if len(batch) < 500:
            return found
        start = batch[-1].seq + 1


async def last_diffs(s: Setting, run_id: str, start: int, tasks: list[str]) -> dict[str, str]:
    """Each of `tasks`' last witnessed `task.diff` in the run (the done attempt's, or the one
    a retry carried); a task with none is absent."""
    found: dict[str, str] = {}
    for value in await witnessed(s, run_id, start, rec.TaskDiff):
        if value.task in tasks:
            found[value.task] = value.diff
    return found


async def space_of(s: Setting, run: Run) -> RunDirs:
    """The run's dirs with its snapshot on disk (taken again, and checked, after a restart)."""
    view = s.views[run.id]
    if run.space is None or not run.space.has_base():
        await _restore(s, run, view)
    assert run.space is not None
    return run.space


async def _restore(s: Setting, run: Run, view: RunView) -> None:
    """A resumed run's snapshot, taken again: refused unless it is the witnessed one."""
    assert view.workspace is not None
    if run.space is not None:
        await asyncio.to_thread(run.space.remove)
    space, body = await snapshot(s, run.id, view.workspace)
    if body.content != view.workspace_content:
        await asyncio.to_thread(space.remove)
        raise ViewFailed(
            f"the workspace {view.workspace} changed since the run's snapshot (its visible "
            f"files are not the ones witnessed): `tally retry {run.id}` runs what is not done "
            "on the workspace as it is now, carrying the done tasks' changes"
        )
    run.space = space


async def patch(s: Setting, run: Run, plan: Plan) -> None:
    """Witness `run.patch`: every done task's changes combined, against the snapshot."""
    view = s.views[run.id]
    if view.workspace is None:
        return
    done = [t for t in plan.tasks if (tv := view.task(t.id)) is not None and tv.state == "done"]
    diffs = [await diff_of(s, run, t.id) for t in done]
    if run.space is None or not run.space.has_base():
        await _restore(s, run, view)
    space = run.space
    assert space is not None
    error = None
    try:
        combined = await asyncio.to_thread(space.combine, diffs)
        body = rec.RunPatch(
            patch=combined.diff,
            files=combined.files,
            tasks=[t.id for t in done],
            before=combined.before,
            after=combined.after,
        )
    except ViewFailed as exc:
        error = f"the tasks' changes conflict: {exc}"
        body = rec.RunPatch(
            patch="", files=[], tasks=[t.id for t in done], before={}, after={}, error=error
        )
    parent = max((tv.verdict_seq or 0 for t in done if (tv := view.task(t.id))), default=0)
    await s.witness(run.id, body, parent or view.plan_seq)


async def partial_patch(s: Setting, run: Run, plan: Plan) -> None:
    """A failed run's `run.patch`: its done tasks' changes, as a failed run's answer holds their
    outputs (`tally apply` takes them without a retry). None when no task is done, or when a
    restarted run's workspace changed (the failure says enough)."""
    view = s.views[run.id]
    if view.workspace is None or not any(
        (tv := view.task(t.id)) is not None and tv.state == "done" for t in plan.tasks
    ):
        return
    try:
        await patch(s, run, plan)
    except ViewFailed:
        return


async def close(run: Run) -> None:
    """Remove the run's dirs (its snapshot and views) once it stops."""
    if run.space is not None:
        await asyncio.to_thread(run.space.remove)
