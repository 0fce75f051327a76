"""Running git on workspaces and views, with nothing configured to run code.

A workspace is hostile: its `.git/config` could name an fsmonitor, hooks, filters or diff
drivers that git would run as the daemon. Every call here clears the global and system
config, turns fsmonitor and hooks off, and uses only plumbing that reads trees and the index
(`ls-files`, `ls-tree`, `rev-parse`) on a user's repository. The one command that reads and
writes its working files (`git apply`) runs its content filters, whatever `-c` says by name;
`disarmed` lists the repository's own filter and merge drivers and blanks each one. Views are
diffed with a git dir kept outside the view (the task never sees it), so the task cannot
configure git either.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

SAFE = (
    "-c",
    "core.fsmonitor=false",
    "-c",
    "core.hooksPath=/dev/null",
    "-c",
    "core.quotePath=false",
    "-c",
    "diff.noprefix=false",
    "-c",
    "core.autocrlf=false",
)
TIMEOUT_S = 120.0


class GitFailed(RuntimeError):
    def __init__(self, argv: Sequence[str], code: int, stderr: str) -> None:
        self.code = code
        self.stderr = stderr
        super().__init__(f"git {' '.join(argv[:3])} failed ({code}): {stderr.strip()[:500]}")


def environment(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {key: os.environ[key] for key in ("PATH", "LANG", "LC_ALL") if key in os.environ}
    env |= {
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_CONFIG_GLOBAL": os.devnull,
        "GIT_TERMINAL_PROMPT": "0",
        "GIT_AUTHOR_NAME": "tally",
        "GIT_AUTHOR_EMAIL": "tally@localhost",
        "GIT_COMMITTER_NAME": "tally",
        "GIT_COMMITTER_EMAIL": "tally@localhost",
        "HOME": os.devnull,
    }
    return env | dict(extra or {})


def git(
    args: Sequence[str],
    cwd: Path,
    *,
    env: Mapping[str, str] | None = None,
    stdin: bytes | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess[bytes]:
    """Run `git SAFE… args` in `cwd` (blocking: call it from a worker thread)."""
    argv = ["git", *SAFE, *args]
    done = subprocess.run(
        argv,
        cwd=cwd,
        env=environment(env),
        input=stdin,
        capture_output=True,
        timeout=TIMEOUT_S,
        check=False,
    )
    if check and done.returncode != 0:
        raise GitFailed(list(args), done.returncode, done.stderr.decode(errors="replace"))
    return done


DRIVER_KEYS = ("clean", "smudge", "process")


def disarmed(repository: Path) -> tuple[dict[str, str], bool]:
    """(environment that blanks every content filter the repository's config defines, whether
    it defines a merge driver). Read with `git config` (which runs nothing); the overrides go
    through GIT_CONFIG_KEY_n so a driver name holding `=` or dots is passed as it is. A blank
    `clean`/`smudge`/`process` is no filter (the file is taken byte for byte, as the snapshot
    took it); a merge driver cannot be blanked, so a caller skips what would merge."""
    done = git(["config", "--list", "-z", "--name-only"], repository, check=False)
    overrides: dict[str, str] = {}
    merge = False
    for raw in done.stdout.split(b"\0"):
        key = raw.decode("utf-8", "surrogateescape")
        section, _, rest = key.partition(".")
        name, _, leaf = rest.rpartition(".")
        if section == "filter" and name and leaf in (*DRIVER_KEYS, "required"):
            overrides |= {f"filter.{name}.{k}": "" for k in DRIVER_KEYS}
            overrides[f"filter.{name}.required"] = "false"
        elif section == "merge" and name and leaf == "driver":
            merge = True
    env = {"GIT_CONFIG_COUNT": str(len(overrides))}
    for i, (key, value) in enumerate(overrides.items()):
        env[f"GIT_CONFIG_KEY_{i}"] = key
        env[f"GIT_CONFIG_VALUE_{i}"] = value
    return env, merge


def toplevel(path: Path) -> Path | None:
    """The repository `path` is the top of, or None (not a repository, or a subdirectory of
    one: a workspace inside a repository is taken as plain files)."""
    ceiling = {"GIT_CEILING_DIRECTORIES": str(path.parent)}
    done = git(["rev-parse", "--show-toplevel"], path, env=ceiling, check=False)
    if done.returncode != 0:
        return None
    top = Path(done.stdout.decode(errors="replace").strip())
    return path if os.path.realpath(top) == os.path.realpath(path) else None
