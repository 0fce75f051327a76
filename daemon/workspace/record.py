"""The entries workspaces add to a run's record, one pydantic model per kind.

Each body is plain JSON (no floats); `model_dump()` is what is witnessed. Parents (in brackets):
- `workspace.snapshot` [run.request]: what the tasks will see of the workspace.
- `task.diff` [task.result]: one attempt's changes to its view, a unified diff.
- `check.run` [task.diff | task.result | the previous check.run]: one `run` check.
- `run.patch` [the last task.verdict]: the done tasks' changes combined, against the snapshot.
- `workspace.apply` [run.patch]: the patch applied to the workspace (actor: the client).
- `workspace.carry` [run.plan]: a retried run's reused tasks' changes carried onto its fresh
  snapshot (see `carry`); then per carried task `task.reuse` [run.plan] and a `task.diff`
  (attempt 0) [that task.reuse] with its changes against the new snapshot.
"""

from __future__ import annotations

from typing import Final, Literal

from pydantic import BaseModel, ConfigDict

SNAPSHOT: Final = "workspace.snapshot"
TASK_DIFF: Final = "task.diff"
CHECK_RUN: Final = "check.run"
PATCH: Final = "run.patch"
APPLY: Final = "workspace.apply"
CARRY: Final = "workspace.carry"
KINDS: Final = (SNAPSHOT, TASK_DIFF, CHECK_RUN, PATCH, APPLY, CARRY)


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SnapshotBody(_Body):
    """The workspace's identity as the tasks see it. `content` is the SHA-256 of the visible
    files' manifest (path, mode, content hash); a git repository adds its `head` and `dirty`,
    the SHA-256 of its uncommitted changes to visible files (None: none)."""

    path: str
    kind: Literal["git", "files"]
    head: str | None
    dirty: str | None
    content: str
    files: int
    bytes: int
    hidden: int
    """Files left out because they match `[policy.workspace] hide`."""
    skipped: list[str]
    """Paths left out for another reason (a symlink out of the workspace, a special file)."""


class DiffBody(_Body):
    task: str
    attempt: int
    diff: str
    files: list[str]
    error: str | None = None


class CheckBody(_Body):
    task: str
    attempt: int
    argv: list[str]
    exit_code: int | None
    timed_out: bool
    stdout_tail: str
    stderr_tail: str
    duration_ms: int
    source: Literal["task", "lane"]


class PatchBody(_Body):
    """`before`/`after`: each touched path's SHA-256 in the snapshot and with the patch
    (None: the file does not exist), so apply can refuse files changed since the snapshot."""

    patch: str
    files: list[str]
    tasks: list[str]
    before: dict[str, str | None]
    after: dict[str, str | None]
    error: str | None = None


class ApplyBody(_Body):
    """`ok` false: refused (`error` says why), nothing written. `method` "none" with ok:
    nothing to do (an empty patch, or one applied already, `error` "already applied")."""

    path: str
    ok: bool
    method: Literal["git-3way", "git-apply", "none"]
    files: list[str]
    error: str | None
    client: str
    check: bool = False


class CarryBody(_Body):
    """A retry's reuse of the original's done tasks on the workspace as it is now.

    `from_content`/`content`: the original's snapshot and this run's (equal: the workspace's
    visible files did not change). `carried`: the tasks taken as done, their diffs applied;
    `changed`: per carried task, files it changes that are not as the original saw them (its
    diff applied nonetheless); `redo`: tasks the original had done that run again, with why."""

    from_run: str
    from_content: str | None
    content: str
    carried: list[str]
    changed: dict[str, list[str]]
    redo: dict[str, str]
