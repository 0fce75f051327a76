"""A run's dirs on disk: the snapshot's base, a git dir beside it, one view per task attempt.

Layout under the daemon's task root (removed with the run; at start every `tally-task-*` dir
is cleared): `tally-task-ws-<run>/base` (the snapshot), `git/` (a bare git dir the sandbox
never binds: it diffs the views), `<task>.<attempt>/` (a view). A view is a reflink copy of
the base with the changes of the tasks it needs applied in plan order; the task works on it
in the sandbox; `capture` diffs it against the tree it started from. The git dir is ours and
its config empty, so nothing a task writes in its view (a `.gitattributes`, a `.git`) makes
git run code; the user's repository is never touched here.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from daemon.workspace.git import GitFailed, git

MAX_DIFF = 1 << 20
"""A task's changes are at most this many bytes of unified diff (else the attempt fails)."""
EXCLUDES = ("__pycache__/", "*.pyc", ".pytest_cache/", ".mypy_cache/", ".ruff_cache/")


DIFF = (
    "diff",
    "--binary",
    "--full-index",
    "--no-color",
    "--no-ext-diff",  # nothing a hostile repository configures runs
    "--no-textconv",
    "--no-renames",
)
"""How a view's changes are diffed, for a task's diff and the run's combined one alike."""


@dataclass(frozen=True)
class Combined:
    diff: str
    files: list[str]
    before: dict[str, str | None]
    after: dict[str, str | None]


class ViewFailed(RuntimeError):
    """A view could not be made or read (an upstream diff that does not apply, a diff too
    large): the attempt fails with this message."""


@dataclass(frozen=True)
class View:
    path: Path
    """The directory the task works in (bound into the sandbox as its working dir)."""
    start: str | None
    """The git tree id the view started from (None: no workspace, nothing is diffed)."""
    index: Path


class RunDirs:
    """One run's dirs under the daemon's task root."""

    def __init__(self, tasks_root: Path | None, run_id: str) -> None:
        import tempfile

        root = tasks_root or Path(tempfile.gettempdir())
        self.root = root / f"tally-task-ws-{run_id}"
        self.base = self.root / "base"
        self.gitdir = self.root / "git"

    def prepare(self, hide: list[str]) -> None:
        """Make the run's dir and its git dir (the base is `snapshot.take`'s to fill)."""
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        if not self.gitdir.exists():
            git(["init", "-q", "--bare", str(self.gitdir)], self.root)
            excludes = "\n".join([*EXCLUDES, *hide]) + "\n"
            (self.gitdir / "info").mkdir(exist_ok=True)
            (self.gitdir / "info" / "exclude").write_text(excludes)

    def has_base(self) -> bool:
        return self.base.is_dir()

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def _git(self, view: Path, index: Path, args: list[str]) -> bytes:
        env = {
            "GIT_DIR": str(self.gitdir),
            "GIT_WORK_TREE": str(view),
            "GIT_INDEX_FILE": str(index),
        }
        return git(args, view, env=env).stdout

    def tree(self, view: Path, index: Path) -> str:
        """The git tree id of everything in `view` (git's excludes and ours left out)."""
        self._git(view, index, ["add", "-A", "--", "."])
        return self._git(view, index, ["write-tree"]).decode().strip()

    def open(self, name: str, upstream: list[str], workspace: bool) -> View:
        """A fresh view for one attempt: the base (or an empty dir) plus upstream diffs."""
        path = self.root / name
        if path.exists():
            shutil.rmtree(path)
        index = self.root / f"{name}.index"
        index.unlink(missing_ok=True)
        if not workspace:
            path.mkdir(parents=True, mode=0o700)
            return View(path=path, start=None, index=index)
        done = subprocess.run(
            ["cp", "-a", "--reflink=auto", "--", f"{self.base}/.", str(path)],
            capture_output=True,
            check=False,
        )
        if done.returncode != 0:
            raise ViewFailed(f"could not copy the snapshot: {done.stderr.decode()[:300]}")
        for number, diff in enumerate(upstream):
            if diff.strip():
                self.apply(path, diff, f"upstream change {number + 1}")
        return View(path=path, start=self.tree(path, index), index=index)

    def apply(self, path: Path, diff: str, what: str) -> None:
        """Apply a diff tally made to a dir of ours (a view, a combination)."""
        env = {"GIT_CEILING_DIRECTORIES": str(path.parent)}
        try:
            git(
                ["apply", "--whitespace=nowarn", "--binary", "-"],
                path,
                env=env,
                stdin=diff.encode("utf-8", "surrogateescape"),
            )
        except GitFailed as exc:
            raise ViewFailed(f"{what} does not apply: {exc.stderr.strip()[:500]}") from None

    def capture(self, view: View) -> tuple[str, list[str]]:
        """The attempt's changes: (unified diff against the view's start, the paths)."""
        if view.start is None:
            return "", []
        end = self.tree(view.path, view.index)
        if end == view.start:
            return "", []
        raw = self._git(
            view.path,
            view.index,
            [*DIFF, view.start, end],
        )
        if len(raw) > MAX_DIFF:
            raise ViewFailed(f"the task's changes are {len(raw)} bytes of diff; at most {MAX_DIFF}")
        diff = raw.decode("utf-8", "surrogateescape")
        return diff, touched(diff, self.root)

    def combine(self, diffs: list[str]) -> Combined:
        """Every diff applied in order to a copy of the base: the combined diff, its paths,
        and each path's content hash in the base and with the diff."""
        view = self.open("combined", diffs, workspace=True)
        try:
            start = self.tree(self.base, self.root / "base.index")
            end = self.tree(view.path, view.index)
            if start == end:
                return Combined("", [], {}, {})
            raw = self._git(
                view.path,
                view.index,
                [*DIFF, start, end],
            )
            diff = raw.decode("utf-8", "surrogateescape")
            paths = touched(diff, self.root)
            return Combined(diff, paths, hashes(self.base, paths), hashes(view.path, paths))
        finally:
            self.close(view)

    def close(self, view: View) -> None:
        shutil.rmtree(view.path, ignore_errors=True)
        view.index.unlink(missing_ok=True)


def touched(diff: str, cwd: Path) -> list[str]:
    """The paths a diff changes, as `git apply` reads them (unquoted, in order)."""
    if not diff.strip():
        return []
    env = {"GIT_CEILING_DIRECTORIES": str(cwd.parent)}
    out = git(
        ["apply", "--numstat", "-z", "-"],
        cwd,
        env=env,
        stdin=diff.encode("utf-8", "surrogateescape"),
    ).stdout
    paths: dict[str, None] = {}
    for record in out.split(b"\0"):
        if record.count(b"\t") >= 2:
            name = record.split(b"\t", 2)[2]
            paths.setdefault(name.decode("utf-8", "surrogateescape"), None)
    return list(paths)


def hashes(root: Path, paths: list[str]) -> dict[str, str | None]:
    """Each path's content SHA-256 under root (None: absent); symlinks hash their target."""
    import hashlib

    from daemon.workspace.snapshot import file_sha256

    found: dict[str, str | None] = {}
    for rel in paths:
        full = root / rel
        if full.is_symlink():
            found[rel] = hashlib.sha256(os.readlink(full).encode()).hexdigest()
        elif full.is_file():
            found[rel] = file_sha256(full)
        else:
            found[rel] = None
    return found
