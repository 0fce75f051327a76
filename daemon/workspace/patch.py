"""Applying a run's combined patch to the user's workspace: the one way tally writes there.

Refused, before anything is written:
- a path that leaves the workspace: absolute, with `..`, into `.git`, or through a symlink
  (checked on the workspace as it is now, for every path `git apply` would touch);
- a symlink or a submodule the patch would create (a link could point anywhere);
- a touched file whose content is not what the snapshot held (`before`): the workspace
  changed under the patch. If every touched file already holds the patched content, the
  patch was applied already and nothing is done.
A git repository gets `git apply --3way` (which also stages the change), falling back to a
plain `git apply` of the working tree when its index disagrees; other dirs a plain
`git apply`, with git kept from looking above the workspace for a repository.
"""

from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from daemon.workspace.git import GitFailed, disarmed, git, toplevel
from daemon.workspace.paths import PathRefused, check_relative, join
from daemon.workspace.record import PatchBody
from daemon.workspace.view import hashes, touched

_LINK_MODE = re.compile(r"^(new file mode|new mode|old mode|deleted file mode) 1[26]0000$", re.M)


class ApplyRefused(ValueError):
    """The patch may not be applied (the message says why and what to do)."""


@dataclass(frozen=True)
class Applied:
    method: Literal["git-3way", "git-apply", "none"]
    files: list[str]
    already: bool = False


def check_paths(workspace: Path, patch: str) -> list[str]:
    """Every path the patch touches, each checked to stay inside the workspace."""
    with tempfile.TemporaryDirectory(prefix="tally-patch-") as scratch:
        try:
            paths = touched(patch, Path(scratch))
        except GitFailed as exc:
            raise ApplyRefused(f"the patch does not parse: {exc.stderr.strip()[:300]}") from None
    if _LINK_MODE.search(patch):
        raise ApplyRefused("the patch makes or changes a symlink or a submodule; tally refuses")
    for path in paths:
        try:
            join(workspace, check_relative(path))
        except PathRefused as exc:
            raise ApplyRefused(f"the patch leaves the workspace: {exc}") from None
    return paths


def apply(workspace: Path, body: PatchBody, check: bool) -> Applied:
    """Apply (or with `check`, only try) the patch; ApplyRefused says why it cannot."""
    if not body.patch.strip():
        return Applied(method="none", files=[])
    paths = check_paths(workspace, body.patch)
    if set(paths) != set(body.files):
        raise ApplyRefused("the patch touches other paths than its record says; refusing")
    now = hashes(workspace, paths)
    if now == body.after and now != body.before:
        return Applied(method="none", files=paths, already=True)
    changed = sorted(p for p in paths if now.get(p) != body.before.get(p))
    if changed:
        raise ApplyRefused(
            f"the workspace changed since the run's snapshot: {', '.join(changed[:20])}; "
            "the patch was made for the files as they were. Stash or undo your changes to "
            "them (`git stash`; committing them does not help), or submit the run again on "
            "the workspace as it is now",
        )
    data = body.patch.encode("utf-8", "surrogateescape")
    extra = ["--check"] if check else []
    # the repository's own filters would run as the daemon: blanked; its merge drivers
    # cannot be, so a repository that defines one gets the plain apply (which merges nothing)
    env, merges = disarmed(workspace)
    if toplevel(workspace) is not None and not merges:
        try:
            git(
                ["apply", "--3way", "--whitespace=nowarn", *extra, "-"],
                workspace,
                env=env,
                stdin=data,
            )
            return Applied(method="git-3way", files=paths)
        except GitFailed:
            pass  # e.g. a touched file's index entry differs from its working copy
    env["GIT_CEILING_DIRECTORIES"] = str(workspace.parent)
    try:
        git(["apply", "--whitespace=nowarn", *extra, "-"], workspace, env=env, stdin=data)
    except GitFailed as exc:
        raise ApplyRefused(f"the patch does not apply: {exc.stderr.strip()[:500]}") from None
    return Applied(method="git-apply", files=paths)
