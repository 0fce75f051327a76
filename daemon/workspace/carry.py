"""Carrying a retried run's reused tasks' changes onto a fresh snapshot of the workspace.

A retry takes the workspace as it is now, not as the original run saw it: the user may have
edited, committed or reverted files since. Each task the retry reuses brings its recorded
`task.diff`; it is applied with git, in plan order, to a copy of the fresh snapshot plus the
carried changes of the tasks it needs (as a view of that task would be made), and its
changes are diffed again there, so the retried run's diffs and combined patch are against
its own snapshot. A diff that no longer applies is not forced: that task (and every task
that needs it) runs again instead, and `Carried.redo` says why. A diff that applies to files
that changed since the original saw them is carried, and `Carried.changed` names those files
(the diff's preimage blob ids, recorded with `--full-index`, against the file now).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from daemon.workspace.git import GitFailed
from daemon.workspace.snapshot import blob_id
from daemon.workspace.view import RunDirs, ViewFailed, touched

_INDEX = re.compile(r"^index ([0-9a-f]{40,64})\.\.([0-9a-f]{40,64})", re.M)
_SECTION = re.compile(r"^diff --git ", re.M)


@dataclass(frozen=True)
class Reused:
    """A task the retry would reuse: its id, the tasks it needs (transitively, plan order)
    and its diff as the original run witnessed it."""

    task: str
    needs: Sequence[str]
    diff: str


@dataclass
class Carried:
    diffs: dict[str, str] = field(default_factory=dict)
    """Each carried task's changes, diffed again against the fresh snapshot."""
    files: dict[str, list[str]] = field(default_factory=dict)
    changed: dict[str, list[str]] = field(default_factory=dict)
    """Per carried task, the files it changes whose content is not what the original saw."""
    redo: dict[str, str] = field(default_factory=dict)
    """Tasks that run again instead, each with why."""


def carry(space: RunDirs, reused: Sequence[Reused], known: Mapping[str, str]) -> Carried:
    """Carry each of `reused` (in plan order) onto `space`'s base. `known`: the diffs of tasks
    the run has taken as done already (a resumed retry), which those here may need."""
    carried = Carried()
    have = dict(known)
    for item in reused:
        missing = [need for need in item.needs if need not in have]
        if missing:
            carried.redo[item.task] = (
                f"it needs {', '.join(missing)}, which runs again, so its work may differ"
            )
            continue
        name = "carry-" + hashlib.sha256(item.task.encode()).hexdigest()[:16]
        try:
            view = space.open(name, [have[need] for need in item.needs], workspace=True)
        except ViewFailed as exc:
            carried.redo[item.task] = f"the changes of the tasks it needs do not combine: {exc}"
            continue
        try:
            stale = preimage_changed(space, view.path, item.diff)
            if item.diff.strip():
                space.apply(view.path, item.diff, "its recorded diff")
            diff, files = space.capture(view)
        except (ViewFailed, GitFailed) as exc:
            why = exc.stderr.strip()[:500] if isinstance(exc, GitFailed) else str(exc)
            carried.redo[item.task] = f"{why} (its files changed since)" if stale else why
            continue
        finally:
            space.close(view)
        have[item.task] = diff
        carried.diffs[item.task] = diff
        carried.files[item.task] = files
        if stale:
            carried.changed[item.task] = stale
    return carried


def preimage_changed(space: RunDirs, root: Path, diff: str) -> list[str]:
    """The paths `diff` changes whose content under `root` is not the one the diff was made
    from (its `index OLD..NEW` line; an all-zero OLD: the file did not exist)."""
    stale: list[str] = []
    starts = [m.start() for m in _SECTION.finditer(diff)]
    ends = [*starts[1:], len(diff)] if starts else []
    for begin, end in zip(starts, ends, strict=True):
        section = diff[begin:end]
        index = _INDEX.search(section)
        if index is None:
            continue  # a mode change alone: no content to compare
        paths = touched(section, space.root)
        if not paths:
            continue
        path = paths[0]
        old = index.group(1)
        full = root / path
        exists = full.is_symlink() or full.is_file()
        if set(old) == {"0"}:
            if exists:
                stale.append(path)
        elif not exists or blob_id(full) != old:
            stale.append(path)
    return stale
