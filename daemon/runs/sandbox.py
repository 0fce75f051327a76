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
- No capabilities (`--cap-drop ALL`, which matters when the daemon runs as root) and no further
  user namespaces (`--disable-userns`, where bwrap can): a task can neither remount its tmpfs
  larger nor mount a fresh, unsized one in a namespace of its own.
- The task's memory budget (`memory_mb`) is split: `tmpfs_sizes` gives every writable tmpfs
  (`/tmp`, `/dev/shm`, `/run`) a `--size`, together `tmpfs_mb`; each process's address space
  gets the rest. The sandbox's root and `/dev` are remounted read-only, so no unsized tmpfs is
  writable. Its working dir is on disk, counted by `daemon.runs.limits.DiskQuota` while it runs;
  where a cgroup v2 memory controller answers, `MemoryMax` bounds the whole task. A seccomp
  filter (`daemon.runs.seccomp`) refuses `memfd_create`, `shmget` and `msgget`: memory that
  neither a tmpfs size nor RLIMIT_AS counts.
- The environment is cleared and rebuilt from the allow-list; rlimits (address space, processes,
  file size, descriptors: `task_nofile`) are applied by `prlimit` inside the sandbox, so they
  bind the task, not bwrap.
`sandbox = "none"` runs the same argv with the same rlimits and env, unconfined: an explicit
roster opt-in that the daemon witnesses at start-up (no tmpfs: its processes get `memory_mb`).
Either way a task runs `TASK_NICENESS` steps nicer than the daemon (`nice`, when installed), so
busy tasks take the CPU after the daemon's event loop, not from it.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from daemon.errors import InvalidInput
from daemon.plans import Plan
from daemon.runs.limits import MemoryCgroup
from roster.models import CommandPolicy

log = logging.getLogger(__name__)
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
    memory_cgroup: MemoryCgroup | None = None
    """The cgroup memory limit detected at start (`limits.detect_memory_cgroup`); None = none."""


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


def tmpfs_sizes(policy: CommandPolicy) -> dict[str, int]:
    """Each writable tmpfs in the sandbox and its size in bytes: together `tmpfs_mb`
    (`/run` 1 MiB, `/dev/shm` a quarter of the rest, `/tmp` the remainder)."""
    total = policy.tmpfs_total_mb * MB
    run = MB
    shm = (total - run) // 4 // 4096 * 4096
    return {"/tmp": total - run - shm, "/dev/shm": shm, "/run": run}


def address_space_mb(policy: CommandPolicy) -> int:
    """Each process's RLIMIT_AS: what `memory_mb` leaves after the sandbox's tmpfs."""
    if policy.sandbox == "none":
        return policy.memory_mb
    return policy.memory_mb - policy.tmpfs_total_mb


FD_KERNEL_BYTES = 512 * 1024
"""What one descriptor can hold in kernel buffers no other limit counts: a pipe grown to 1 MiB
(two ends), a socket's send buffer (3000 socket pairs held 667 MiB under memory_mb = 64)."""
MIN_NOFILE = 256


def task_nofile(policy: CommandPolicy) -> int:
    """A task's RLIMIT_NOFILE: `memory_mb` over FD_KERNEL_BYTES, at least MIN_NOFILE (the
    daemon raised its own soft limit to the hard one, and a task would inherit it)."""
    return min(1 << 16, max(MIN_NOFILE, policy.memory_mb * MB // FD_KERNEL_BYTES))


def prlimit_argv(policy: CommandPolicy) -> list[str]:
    prlimit = _which("prlimit") or "/usr/bin/prlimit"
    return [
        prlimit,
        f"--as={address_space_mb(policy) * MB}",
        f"--nproc={policy.processes}",
        f"--nofile={task_nofile(policy)}",
        # one file never outgrows the task dir's quota, whatever the watcher's pace
        f"--fsize={min(policy.file_size_mb, policy.disk_mb) * MB}",
        "--",
    ]


_USERNS_FLAGS: dict[str, list[str]] = {}


def userns_flags(bwrap: str) -> list[str]:
    """`--unshare-user --disable-userns` where this bwrap can (a kernel with unprivileged user
    namespaces; bwrap 0.8+), tried once per bwrap. Where it cannot, a task cannot make user
    namespaces either, so nothing is lost."""
    if bwrap not in _USERNS_FLAGS:
        flags = ["--unshare-user", "--disable-userns"]
        true = _which("true") or "/bin/true"
        probe = [bwrap, "--unshare-all", *flags, "--ro-bind", "/", "/", "--", true]
        try:
            ok = subprocess.run(probe, capture_output=True, timeout=10, check=False).returncode
        except (OSError, subprocess.TimeoutExpired):
            ok = 1
        if ok != 0:
            log.warning("bwrap cannot --disable-userns here: tasks keep the kernel's default")
        _USERNS_FLAGS[bwrap] = flags if ok == 0 else []
    return _USERNS_FLAGS[bwrap]


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
            if os.path.isdir(real):  # an empty, read-only dir: nothing to fill
                args += ["--size", "4096", "--tmpfs", real, "--remount-ro", real]
            else:
                args += ["--ro-bind", "/dev/null", real]
    return args


def wrap(
    argv: Sequence[str],
    *,
    policy: CommandPolicy,
    workdir: Path,
    env: dict[str, str],
    network: bool,
    hidden: Sequence[Path],
    info_fd: int | None = None,
    memory_cgroup: MemoryCgroup | None = None,
    seccomp_fd: int | None = None,
) -> list[str]:
    """The argv that runs `argv` confined as the module docstring says.

    `info_fd`: a descriptor the child inherits, on which bwrap writes the sandbox init's pid
    (for `limits.TmpfsProbe`). `memory_cgroup`: run the sandbox in a scope whose `MemoryMax`
    is `memory_mb` (its `env` must then be in the environment `systemd-run` starts with).
    `seccomp_fd`: a descriptor the child inherits holding the seccomp program (`seccomp.pipe`),
    loaded by bwrap before it execs the task."""
    limited = [*prlimit_argv(policy), *argv]
    if policy.sandbox == "none":
        return [*nice_argv(), *limited]
    bwrap = bwrap_path()
    scope = memory_cgroup.prefix(policy.memory_mb) if memory_cgroup is not None else []
    args = [*scope, *nice_argv(), bwrap, "--die-with-parent", "--new-session", "--unshare-all"]
    args += [*userns_flags(bwrap), "--cap-drop", "ALL"]
    if network:
        args.append("--share-net")
    if info_fd is not None:
        args += ["--info-fd", str(info_fd)]
    sizes = tmpfs_sizes(policy)
    # The empty mounts first: a bind below them (a venv in /tmp) must land on top, not under.
    # `/dev` holds only device nodes (read-only; a node's I/O is not a write to `/dev`), and
    # `/dev/shm` is its one sized, writable tmpfs.
    args += ["--proc", "/proc", "--dev", "/dev"]
    args += ["--size", str(sizes["/dev/shm"]), "--tmpfs", "/dev/shm", "--remount-ro", "/dev"]
    args += ["--size", str(sizes["/tmp"]), "--tmpfs", "/tmp"]
    args += ["--size", str(sizes["/run"]), "--tmpfs", "/run"]
    args += _system_binds(hidden, policy.ro_binds)
    for bind in policy.rw_binds:
        args += ["--bind", bind, bind]
    args += ["--bind", str(workdir), str(workdir)]
    # bwrap builds the sandbox's root on a tmpfs of its own, unsized: read-only once built.
    args += ["--remount-ro", "/", "--chdir", str(workdir), "--clearenv"]
    for key, value in env.items():
        args += ["--setenv", key, value]
    # a seccomp filter refuses the calls that hold memory no limit counts (memfd, SysV)
    if seccomp_fd is None:
        raise ValueError("a sandboxed task needs its seccomp program (seccomp.pipe)")
    return [*args, "--seccomp", str(seccomp_fd), "--", *limited]


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
            remove_task_dir(child)
            removed += 1
    return removed


def remove_task_dir(path: Path) -> None:
    """Remove a task's dir whatever its task did to it, once its processes are gone.

    A task can nest dirs deeper than PATH_MAX or than Python's recursion limit (where
    `shutil.rmtree` raises `RecursionError`), and make dirs unreadable to their owner (mode
    000). So every dir is emptied at depth one: its subdirs are renamed up to the top, and
    each gets its owner's rights back before it is listed. Symlinks are never followed.
    """
    top = str(path)
    if os.path.islink(top) or not os.path.isdir(top):
        with contextlib.suppress(OSError):
            os.unlink(top)
        return
    tag = secrets.token_hex(6)
    moved = 0
    pending = [top]
    done: list[str] = []
    while pending:
        current = pending.pop()
        done.append(current)
        with contextlib.suppress(OSError):
            os.chmod(current, 0o700)
        try:
            with os.scandir(current) as listing:
                entries = list(listing)
        except OSError:
            continue
        for entry in entries:
            if not entry.is_dir(follow_symlinks=False):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
            elif current == top:
                pending.append(entry.path)
            else:
                moved += 1
                flat = os.path.join(top, f".tally-flat-{tag}-{moved}")
                with contextlib.suppress(OSError):
                    os.rename(entry.path, flat)
                    pending.append(flat)
    for emptied in reversed(done):  # the top last
        with contextlib.suppress(OSError):
            os.rmdir(emptied)
