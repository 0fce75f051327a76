"""Where a command task runs: a bubblewrap sandbox that cannot reach the record or the daemon.

Contract, for `sandbox = "bwrap"` (the default):
- The filesystem is an allow-list: the system dirs (`SYSTEM_DIRS`) and the Python prefixes the
  daemon runs from, read-only, plus the roster's `ro_binds`; the task's own temporary dir is the
  only writable path (with the roster's `rw_binds`). The state dir, the runtime dir, the
  credentials dir and the home dir are never bound; if an allowed dir contains one of them, it
  is covered with an empty tmpfs (or /dev/null for a file).
- `--unshare-all`: own PID, IPC, UTS, cgroup, user and network namespaces. `/proc` shows only
  the task's processes; the network is a down loopback unless policy and task both allow it.
- `--die-with-parent` + killing bwrap kills the namespace's init, and with it every descendant,
  `setsid` or not: cancel and timeout kill the process group of bwrap with SIGKILL.
- The environment is cleared and rebuilt from the allow-list; rlimits (address space, processes,
  file size) are applied by `prlimit` inside the sandbox, so they bind the task, not bwrap.
`sandbox = "none"` runs the same argv with the same rlimits and env, unconfined: an explicit
roster opt-in that the daemon witnesses at start-up.
Either way a task runs `TASK_NICENESS` steps nicer than the daemon (`nice`, when installed), so
busy tasks take the CPU after the daemon's event loop, not from it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from daemon.errors import InvalidInput
from daemon.planning import Plan
from roster.models import CommandPolicy

TASK_NICENESS = 10
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/opt")
MB = 1024 * 1024


class SandboxUnavailable(InvalidInput):
    """The roster asks for a sandbox this machine cannot provide (e.g. no `bwrap`)."""

    code = "sandbox_unavailable"


@dataclass(frozen=True)
class Confinement:
    """What the daemon lends the command executor: paths no task may see, where task dirs go."""

    hidden: tuple[Path, ...] = ()
    tasks_root: Path | None = None
    """Parent of every task's temporary dir (one per daemon, emptied at start); None = $TMPDIR."""


def python_prefixes() -> tuple[str, ...]:
    """The daemon's own interpreter and venv, so `python3` tasks behave as they do outside."""
    seen: list[str] = []
    for prefix in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix):
        real = os.path.realpath(prefix)
        if real not in seen and not real.startswith(SYSTEM_DIRS):
            seen.append(real)
    return tuple(seen)


def _inside(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def _reveals(bind: str, hidden: Iterable[Path]) -> bool:
    """True if binding `bind` would show (part of) a hidden path."""
    real = os.path.realpath(bind)
    return any(
        _inside(real, os.path.realpath(h)) or _inside(os.path.realpath(h), real) for h in hidden
    )


def check_binds(policy: CommandPolicy, hidden: Sequence[Path]) -> None:
    """Refuse roster binds that would expose the state, runtime, key or home dirs."""
    for bind in (*policy.ro_binds, *policy.rw_binds):
        if _reveals(bind, hidden):
            raise InvalidInput(
                f"[policy.command] bind {bind!r} would expose a path tasks must not see",
                details={"bind": bind},
            )


_FOUND: dict[tuple[str, str | None], str] = {}
"""Programs found on a PATH: not searched again on every command task (a search is a stat
per PATH entry, on the event loop)."""


def _which(program: str) -> str | None:
    key = (program, os.environ.get("PATH"))
    if key not in _FOUND and (path := shutil.which(program)) is not None:
        _FOUND[key] = path
    return _FOUND.get(key)


def bwrap_path() -> str:
    found = _which("bwrap")
    if found is None:
        raise SandboxUnavailable(
            "command tasks run in bubblewrap, and `bwrap` is not installed: install it "
            "(`apt-get install bubblewrap`), or opt out in the roster with "
            '[policy.command] sandbox = "none"'
        )
    return found


def nice_argv() -> list[str]:
    """The prefix that lowers a task's CPU priority (exec'd in place: the pid stays bwrap's)."""
    nice = _which("nice")
    return [nice, "-n", str(TASK_NICENESS)] if nice is not None else []


def prlimit_argv(policy: CommandPolicy) -> list[str]:
    prlimit = _which("prlimit") or "/usr/bin/prlimit"
    return [
        prlimit,
        f"--as={policy.memory_mb * MB}",
        f"--nproc={policy.processes}",
        f"--fsize={policy.file_size_mb * MB}",
        "--",
    ]


def _system_binds(hidden: Sequence[Path], extra: Iterable[str]) -> list[str]:
    args: list[str] = []
    for path in (*SYSTEM_DIRS, *python_prefixes(), *extra):
        if os.path.islink(path) and path in SYSTEM_DIRS:
            args += ["--symlink", os.readlink(path), path]  # merged /usr: /bin -> usr/bin
        elif os.path.exists(path):
            args += ["--ro-bind", path, path]
    # An allowed dir may hold a hidden one (a venv in $HOME next to the state dir): cover it.
    for h in hidden:
        real = os.path.realpath(h)
        if not os.path.exists(real):
            continue
        allowed = (*SYSTEM_DIRS, *python_prefixes(), *extra)
        if any(_inside(real, os.path.realpath(a)) for a in allowed):
            args += ["--tmpfs", real] if os.path.isdir(real) else ["--ro-bind", "/dev/null", real]
    return args


def wrap(
    argv: Sequence[str],
    *,
    policy: CommandPolicy,
    workdir: Path,
    env: dict[str, str],
    network: bool,
    hidden: Sequence[Path],
) -> list[str]:
    """The argv that runs `argv` confined as the module docstring says."""
    limited = [*prlimit_argv(policy), *argv]
    if policy.sandbox == "none":
        return [*nice_argv(), *limited]
    args = [*nice_argv(), bwrap_path(), "--die-with-parent", "--new-session", "--unshare-all"]
    if network:
        args.append("--share-net")
    # The empty mounts first: a bind below them (a venv in /tmp) must land on top, not under.
    args += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--tmpfs", "/run"]
    args += _system_binds(hidden, policy.ro_binds)
    for bind in policy.rw_binds:
        args += ["--bind", bind, bind]
    args += ["--bind", str(workdir), str(workdir), "--chdir", str(workdir), "--clearenv"]
    for key, value in env.items():
        args += ["--setenv", key, value]
    return [*args, "--", *limited]


def admit_commands(plan: Plan, policy: CommandPolicy, hidden: Sequence[Path] = ()) -> None:
    """Refuse, before anything runs, command tasks the roster's policy does not allow."""
    commands = [task for task in plan.tasks if task.executor == "command"]
    if not commands:
        return
    check_binds(policy, hidden)
    if not policy.enabled:
        raise InvalidInput(
            "the command executor is off in this roster ([policy.command] enabled = false)",
            details={"tasks": [t.id for t in commands]},
        )
    for task in commands:
        if policy.lanes is not None and task.lane not in policy.lanes:
            raise InvalidInput(
                f"task {task.id}: lane {task.lane!r} may not run commands "
                f"([policy.command] lanes = {policy.lanes})",
                details={"task": task.id, "lane": task.lane},
            )
        if task.network and not policy.network:
            raise InvalidInput(
                f"task {task.id} asks for the network, which [policy.command] network = false "
                "does not allow",
                details={"task": task.id},
            )
    if policy.sandbox == "bwrap":
        bwrap_path()


def tasks_root(state_dir: Path) -> Path:
    """One parent per daemon (per state dir) for task dirs, outside the state dir's disk quota
    and emptied at start: the state dir's lock means no other daemon uses it."""
    tag = hashlib.sha256(str(state_dir.resolve()).encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"tally-tasks-{os.getuid()}-{tag}"


def clear_task_dirs(root: Path | None) -> int:
    """Remove the task dirs a killed daemon left behind (every run is over or interrupted at
    start; a resumed task gets a fresh dir). Returns how many were removed."""
    if root is None or not root.is_dir():
        return 0
    removed = 0
    for child in root.iterdir():
        if child.name.startswith("tally-task-"):
            shutil.rmtree(child, ignore_errors=True)
            removed += 1
    return removed
