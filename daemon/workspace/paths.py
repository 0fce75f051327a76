"""Relative paths a task, a plan or a patch names: checked before any file is touched.

Every path that reaches the file system from outside (a plan's `files`, an edit in a model's
answer, a patch's headers) is relative, has no `..`, no NUL, does not reach into `.git`, and
is joined to its root without following a symlink on the way (`join`).
"""

from __future__ import annotations

import fnmatch
import os
from collections.abc import Iterable
from pathlib import Path, PurePosixPath

MAX_PATH = 4096


class PathRefused(ValueError):
    """A path that would leave its root (or is malformed): the message says which and why."""


def check_relative(path: str) -> str:
    """The normalized form of a relative path inside a root; PathRefused otherwise."""
    if not path or len(path) > MAX_PATH or "\x00" in path:
        raise PathRefused(f"{path[:200]!r}: not a usable path")
    if path.startswith(("/", "~")):
        raise PathRefused(f"{path!r}: an absolute path; paths are relative to the workspace")
    parts = [p for p in PurePosixPath(path).parts if p not in ("", ".")]
    if not parts:
        raise PathRefused(f"{path!r}: names no file")
    if ".." in parts:
        raise PathRefused(f"{path!r}: '..' would leave the workspace")
    if ".git" in parts:
        raise PathRefused(f"{path!r}: tasks do not write inside .git")
    return "/".join(parts)


def is_hidden(path: str, patterns: Iterable[str]) -> bool:
    """Whether a relative path, or any directory on its way, matches a `hide` pattern."""
    parts = path.split("/")
    for pattern in patterns:
        if fnmatch.fnmatchcase(path, pattern):
            return True
        if any(fnmatch.fnmatchcase(part, pattern) for part in parts):
            return True
    return False


def join(root: Path, path: str) -> Path:
    """`root / path` for a checked relative path, refusing a symlink anywhere on the way
    (a link inside a view could point out of it; nothing is written through one)."""
    rel = check_relative(path)
    at = root
    for part in rel.split("/"):
        at = at / part
        if at.is_symlink():
            raise PathRefused(f"{path!r}: goes through the symlink {part!r}")
    return at


def inside(path: Path, root: Path) -> bool:
    real, base = os.path.realpath(path), os.path.realpath(root)
    return real == base or real.startswith(base.rstrip("/") + "/")
