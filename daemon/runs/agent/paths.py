"""Where an agent's tools may look: paths resolved inside the task's view, and nowhere else.

A path a model names is hostile. It must be relative, free of `..` and NUL, and resolve
(symlinks followed, with `os.path.realpath`) to a place inside the view's own real path; it
must not match a hidden pattern on any of its parts (`.env*`, `*.pem`, …), nor name `.git`
for writing. A file read or written must be a regular file: a FIFO would block the daemon,
a device would read for ever. Every refusal is a `PathRefused` whose message is what the
model sees as the observation, so it says what was wrong and what is allowed.
"""

from __future__ import annotations

import fnmatch
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

MAX_PATH = 1024
DEFAULT_HIDDEN = (".env", ".env.*", "*.pem", "*.key", "id_*", ".netrc", ".git-credentials")


class PathRefused(ValueError):
    """A path the tools will not touch; the message is the model's observation."""


@dataclass(frozen=True)
class Jail:
    """The view's root (its real path) and the patterns no tool may see or write."""

    root: Path
    hidden: tuple[str, ...] = DEFAULT_HIDDEN

    @classmethod
    def of(cls, view: Path, hidden: Sequence[str] = DEFAULT_HIDDEN) -> Jail:
        return cls(root=Path(os.path.realpath(view)), hidden=tuple(hidden))

    def is_hidden(self, rel: str) -> bool:
        """Whether a relative path, or any directory on its way, matches a hidden pattern."""
        parts = rel.split("/")
        return any(
            fnmatch.fnmatchcase(rel, p) or any(fnmatch.fnmatchcase(part, p) for part in parts)
            for p in self.hidden
        )

    def relative(self, path: str) -> str:
        """The normalized relative form of `path` ("" = the view itself); PathRefused if it is
        absolute, climbs with `..`, or is not a usable name."""
        if not isinstance(path, str) or len(path) > MAX_PATH or "\x00" in path:
            raise PathRefused("not a usable path: give a path relative to the project root")
        if path.startswith(("/", "~")):
            raise PathRefused(
                f"{path[:200]!r} is absolute: tools only see the project, give a path relative "
                "to its root (for example 'src/app.py')"
            )
        parts = [p for p in PurePosixPath(path).parts if p not in ("", ".")]
        if ".." in parts:
            raise PathRefused(f"{path[:200]!r} uses '..': tools only see inside the project")
        return "/".join(parts)

    def resolve(self, path: str, *, write: bool = False) -> tuple[str, Path]:
        """(relative path, real path inside the view); PathRefused otherwise.

        The real path is where the file is, symlinks followed: a link that points out of the
        view is refused, whatever its name says. A file that does not exist yet (a write)
        resolves through its nearest existing parent, which must be inside too.
        """
        rel = self.relative(path)
        if rel and self.is_hidden(rel):
            raise PathRefused(f"{rel!r} is hidden from tools (it may hold secrets)")
        if write and (rel == "" or rel.split("/")[0] == ".git"):
            raise PathRefused(f"{rel or '.'!r} cannot be written: write a file of the project")
        real = Path(os.path.realpath(self.root / rel))
        if not self.contains(real):
            raise PathRefused(f"{rel!r} resolves outside the project (a symlink out)")
        real_rel = os.path.relpath(real, self.root)
        if real_rel != "." and self.is_hidden(real_rel):
            raise PathRefused(f"{rel!r} leads to a hidden file (it may hold secrets)")
        return rel, real

    def contains(self, real: Path) -> bool:
        root = str(self.root)
        text = str(real)
        return text == root or text.startswith(root.rstrip("/") + "/")

    def regular(self, rel: str, real: Path) -> os.stat_result:
        """The stat of an existing regular file; PathRefused for anything else."""
        try:
            st = os.stat(real)
        except FileNotFoundError:
            raise PathRefused(f"{rel!r} does not exist (list_files shows what does)") from None
        except OSError as err:
            raise PathRefused(f"{rel!r} cannot be read: {err.strerror}") from None
        if stat.S_ISDIR(st.st_mode):
            raise PathRefused(f"{rel!r} is a directory: use list_files to see what it holds")
        if not stat.S_ISREG(st.st_mode):
            raise PathRefused(f"{rel!r} is not a regular file (a device, a pipe or a socket)")
        return st
