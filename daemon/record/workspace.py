"""The kinds a run's workspace writes (`daemon.workspace.record` declares their fields; here
each is stated as a kind of the record, with its actor and parents).
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import ConfigDict

from daemon.record.body import Body
from daemon.workspace.record import (
    ApplyBody,
    CarryBody,
    CheckBody,
    DiffBody,
    PatchBody,
    SnapshotBody,
)

# Reading is tolerant like every kind's (the workspace's own models refuse extra fields).
_READ = ConfigDict(extra="allow", strict=True, frozen=True)


class WorkspaceSnapshot(SnapshotBody, Body):
    """What of the workspace the run's tasks see: its identity (files, content hash, git head)."""

    model_config = _READ
    KIND: ClassVar[str] = "workspace.snapshot"
    ACTORS: ClassVar[tuple[str, ...]] = ("engine",)
    PARENTS: ClassVar[tuple[str, ...]] = ("run.request",)


class TaskDiff(DiffBody, Body):
    """One attempt's changes to its view of the workspace, as a unified diff."""

    model_config = _READ
    KIND: ClassVar[str] = "task.diff"
    ACTORS: ClassVar[tuple[str, ...]] = ("engine",)
    PARENTS: ClassVar[tuple[str, ...]] = ("task.result", "agent.step", "command.run", "task.reuse")


class CheckRun(CheckBody, Body):
    """One `run` check of a task's attempt, run in the attempt's view."""

    model_config = _READ
    KIND: ClassVar[str] = "check.run"
    ACTORS: ClassVar[tuple[str, ...]] = ("engine",)
    PARENTS: ClassVar[tuple[str, ...]] = ("task.diff", "task.result", "check.run")


class RunPatch(PatchBody, Body):
    """The done tasks' changes combined, against the snapshot (with each file's hashes)."""

    model_config = _READ
    KIND: ClassVar[str] = "run.patch"
    ACTORS: ClassVar[tuple[str, ...]] = ("engine",)
    PARENTS: ClassVar[tuple[str, ...]] = ("task.verdict", "task.reuse", "task.skip", "run.plan")


class WorkspaceApply(ApplyBody, Body):
    """The run's patch applied to the workspace (or refused: `ok` false)."""

    model_config = _READ
    KIND: ClassVar[str] = "workspace.apply"
    ACTORS: ClassVar[tuple[str, ...]] = ("engine",)  # the client is named in the body
    PARENTS: ClassVar[tuple[str, ...]] = ("run.patch",)


class WorkspaceCarry(CarryBody, Body):
    """A retry's reuse of the original's done tasks on the workspace as it is now: the tasks
    carried (their diffs applied to the fresh snapshot), the files that changed since the
    original saw them, and the tasks that run again, with why. Each carried task's
    `task.reuse` follows, then its `task.diff` (attempt 0) against the new snapshot."""

    model_config = _READ
    KIND: ClassVar[str] = "workspace.carry"
    ACTORS: ClassVar[tuple[str, ...]] = ("engine",)
    PARENTS: ClassVar[tuple[str, ...]] = ("run.plan",)
