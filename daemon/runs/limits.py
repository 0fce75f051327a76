"""What a task may hold, counted while it runs: its disk, its in-memory dirs, its memory.

Rlimits bind a process, not a task: RLIMIT_AS does not count tmpfs pages, RLIMIT_FSIZE bounds
one file, not the total. So the sandbox (`daemon.runs.sandbox`) gives every tmpfs a size, and
this module counts the rest:
- `DiskQuota` measures a directory (a task's working dir, or a workspace view bound into the
  sandbox) with a bounded walk, on a worker thread, every few hundred milliseconds while the
  task runs and once after it ends; past its bytes or its entries the caller kills the task.
- `TmpfsProbe` holds a descriptor on each of the sandbox's tmpfs mounts (reached through
  `/proc/PID/root` of the sandbox's init, whose pid bwrap reports on `--info-fd`): their used
  inodes are checked on each tick (a tmpfs `--size` does not bound its inodes, whose kernel
  memory is not counted in it) and their free space after the task ends, to name the limit a
  task ran into.
- `MemoryCgroup` is a cgroup v2 memory limit (a transient systemd scope with `MemoryMax`) that
  counts every page the task holds, shared memory and tmpfs included, where a systemd manager
  with a delegated memory controller answers; detected once at start (`detect_memory_cgroup`).
A limit a task hits is reported as a message that names the limit and the setting.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import shutil
import stat
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

MB = 1024 * 1024
WATCH_INTERVAL_S = 0.05
"""How often a running task's disk and inodes are measured: a task passes its disk quota by
at most what it writes in one interval (or in ten walks' time, for a tree that is slow to
walk: the watch spends at most a tenth of a core)."""


class LimitExceeded(Exception):
    """A task ran into one of its limits; the message names the limit and its setting."""


def _mib(n: int) -> str:
    return f"{n / MB:g} MiB"


@dataclass(frozen=True)
class DiskUsage:
    bytes: int
    entries: int
    complete: bool
    """False when the walk stopped early, past a limit: the numbers are then lower bounds."""
    unmeasured: str | None = None
    """Why part of the tree could not be read (a path past PATH_MAX, a dir made unreadable):
    what it holds is not counted, so a quota treats it as exceeded."""


def disk_usage(
    directory: Path, *, stop_bytes: int | None = None, stop_entries: int | None = None
) -> DiskUsage:
    """Bytes allocated (st_blocks, so a sparse file counts what it holds) and entries below
    `directory`, symlinks not followed, hard links counted once. The walk stops as soon as a
    stop value is passed, so measuring a hostile tree costs at most `stop_entries` stats, or
    at the first part it cannot read."""
    total = entries = 0
    seen: set[tuple[int, int]] = set()
    stack = [str(directory)]
    while stack:
        path = stack.pop()
        try:
            with os.scandir(path) as listing:
                for entry in listing:
                    entries += 1
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue  # removed while we looked
                    if st.st_nlink > 1 and not stat.S_ISDIR(st.st_mode):
                        key = (st.st_dev, st.st_ino)
                        if key in seen:
                            continue
                        seen.add(key)
                    total += st.st_blocks * 512
                    if stat.S_ISDIR(st.st_mode):
                        stack.append(entry.path)
                    if (stop_bytes is not None and total > stop_bytes) or (
                        stop_entries is not None and entries > stop_entries
                    ):
                        return DiskUsage(total, entries, complete=False)
        except (FileNotFoundError, NotADirectoryError):
            continue  # removed, or replaced by a file, while we looked
        except OSError as exc:
            why = os.strerror(exc.errno) if exc.errno else str(exc)
            return DiskUsage(total, entries, complete=False, unmeasured=why)
    return DiskUsage(total, entries, complete=True)


@dataclass(frozen=True)
class DiskQuota:
    """A total quota on one directory: at most `max_bytes` allocated and `max_entries` files
    and dirs. Works on any directory the daemon can read (a tmpfs-free bind mount included):
    it measures, it does not mount. `bytes_setting` and `entries_setting` name where the
    limits are set, for the message a task that passes them fails with."""

    directory: Path
    max_bytes: int
    max_entries: int
    bytes_setting: str = "[policy.command] disk_mb"
    entries_setting: str = "[policy.command] disk_files"
    label: str = "its working dir"

    def check(self) -> str | None:
        """The message naming the limit `directory` is past, or None. Blocking: call it on a
        worker thread."""
        used = disk_usage(self.directory, stop_bytes=self.max_bytes, stop_entries=self.max_entries)
        if used.unmeasured is not None:
            return (
                f"the task left part of {self.label} unreadable to its disk quota check "
                f"({used.unmeasured}), so the quota of {_mib(self.max_bytes)} cannot be "
                f"upheld ({self.bytes_setting})"
            )
        if used.bytes > self.max_bytes:
            return (
                f"the task exceeded its disk quota of {_mib(self.max_bytes)} in {self.label} "
                f"({self.bytes_setting})"
            )
        if used.entries > self.max_entries:
            return (
                f"the task exceeded its quota of {self.max_entries} files and dirs in "
                f"{self.label} ({self.entries_setting})"
            )
        return None

    async def watch(
        self, on_exceeded: Callable[[str], object], interval_s: float = WATCH_INTERVAL_S
    ) -> str:
        """Check every `interval_s` (or ten times the last check's cost, if more: a big tree
        is not walked back to back) until a limit is passed; then call `on_exceeded(message)`
        once and return the message. Runs until cancelled otherwise."""
        while True:
            started = time.monotonic()
            message = await asyncio.to_thread(self.check)
            if message is not None:
                on_exceeded(message)
                return message
            await asyncio.sleep(max(interval_s, 10 * (time.monotonic() - started)))


@dataclass
class TmpfsProbe:
    """The sandbox's tmpfs mounts (`sizes`: mount point -> bytes), seen from the daemon.

    `attach(pid)` opens each mount through `/proc/pid/root` once the sandbox's init has
    switched to its new root: a mount is taken only when its size is the one asked for, so
    the host's own `/tmp` is never measured by mistake. The descriptors keep the mounts
    readable after the task ends, until `close()`.
    """

    sizes: Mapping[str, int]
    max_inodes: int
    setting: str = "[policy.command] tmpfs_mb, a share of memory_mb"
    inodes_setting: str = "[policy.command] disk_files"
    fds: dict[str, int] = field(default_factory=dict)
    memory_mb: int | None = None
    """The task's whole budget: its processes' private memory plus its tmpfs use, checked
    every MEMORY_INTERVAL_S (RLIMIT_AS binds each process: 30 forks of 30 MiB held 900 MiB
    under memory_mb = 64). None: not checked (a cgroup's MemoryMax counts it instead)."""
    pid: int | None = None
    _memory_checked: float = 0.0

    def attach(self, pid: int) -> bool:
        """Open the mounts not yet open; True once all are."""
        for mount, size in self.sizes.items():
            if mount in self.fds:
                continue
            try:
                fd = os.open(f"/proc/{pid}/root{mount}", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            except OSError:
                continue  # not there yet, or the task is gone
            st = os.fstatvfs(fd)
            if st.f_blocks * st.f_frsize == size:
                self.fds[mount] = fd
            else:
                os.close(fd)  # still the host's: the sandbox is being set up
        if len(self.fds) == len(self.sizes):
            self.pid = pid
            return True
        return False

    def over_limit(self) -> str | None:
        """The first limit the running task is past (its tmpfs inodes, its memory), or None."""
        return self.too_many_inodes() or self.too_much_memory()

    def too_much_memory(self) -> str | None:
        """Past `memory_mb`: the anonymous memory of every process in the sandbox (its PSS:
        pages a fork shares count once) plus what its tmpfs mounts hold."""
        now = time.monotonic()
        if self.memory_mb is None or self.pid is None:
            return None
        if now - self._memory_checked < MEMORY_INTERVAL_S:
            return None
        self._memory_checked = now
        held = sum(
            (st.f_blocks - st.f_bfree) * st.f_frsize
            for st in (os.fstatvfs(fd) for fd in self.fds.values())
        )
        proc = f"/proc/{self.pid}/root/proc"
        try:
            pids = [name for name in os.listdir(proc) if name.isdigit()]
        except OSError:
            return None  # the task is gone
        for name in pids[:MAX_PROCESSES_READ]:
            held += _pss_anon(f"{proc}/{name}/smaps_rollup")
        if held > self.memory_mb * MB:
            return (
                f"the task held {_mib(held)} of memory, over its memory_mb of "
                f"{_mib(self.memory_mb * MB)} ([policy.command] memory_mb, its processes and "
                "in-memory dirs together)"
            )
        return None

    def too_many_inodes(self) -> str | None:
        for mount, fd in self.fds.items():
            st = os.fstatvfs(fd)
            if st.f_files - st.f_ffree > self.max_inodes:
                return (
                    f"the task exceeded its quota of {self.max_inodes} files and dirs in "
                    f"its in-memory {mount} ({self.inodes_setting})"
                )
        return None

    def full(self) -> str | None:
        """The message naming the first mount with no free block left, or None."""
        for mount, fd in self.fds.items():
            st = os.fstatvfs(fd)
            if st.f_bavail == 0:
                return (
                    f"the task filled its {mount}, an in-memory dir of "
                    f"{_mib(self.sizes[mount])} ({self.setting})"
                )
        return None

    def close(self) -> None:
        for fd in self.fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds.clear()


MEMORY_INTERVAL_S = 0.25
MAX_PROCESSES_READ = 4096  # a bound on one check's work (RLIMIT_NPROC bounds the rest)


def _pss_anon(path: str) -> int:
    """A process's proportional share of its anonymous memory, in bytes (0 if it is gone)."""
    try:
        with open(path, "rb") as f:
            text = f.read(8192)
    except OSError:
        return 0
    for line in text.splitlines():
        if line.startswith(b"Pss_Anon:"):
            return int(line.split()[1]) * 1024
    return 0


def read_child_pid(info: bytes) -> int | None:
    """The sandbox init's pid from bwrap's `--info-fd` JSON, once it is complete."""
    try:
        value = json.loads(info)
    except ValueError:
        return None
    pid = value.get("child-pid") if isinstance(value, dict) else None
    return pid if isinstance(pid, int) and pid > 0 else None


@dataclass(frozen=True)
class MemoryCgroup:
    """Runs a task in a transient systemd scope whose `MemoryMax` is the task's budget."""

    argv: tuple[str, ...]
    """`systemd-run` and its options, up to the properties."""
    env: Mapping[str, str]
    """What `systemd-run` needs to reach its manager (the task itself never sees it)."""
    mechanism: str

    def prefix(self, memory_mb: int) -> list[str]:
        return [
            *self.argv,
            "-p",
            f"MemoryMax={memory_mb * MB}",
            "-p",
            "MemorySwapMax=0",
            "--",
        ]


_PROBE_MB = 16
_READ_OWN_MAX = 'cat "/sys/fs/cgroup$(sed -n "s/^0:://p" /proc/self/cgroup)/memory.max"'


@functools.cache
def detect_memory_cgroup() -> tuple[MemoryCgroup | None, str]:
    """A cgroup v2 memory limit this machine offers, and a sentence saying which (for the
    start-up log). Blocking (it runs `systemd-run` once): call it on a worker thread."""
    systemd_run = shutil.which("systemd-run")
    if systemd_run is None:
        return None, "no cgroup memory limit: `systemd-run` is not installed"
    if not os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
        return None, "no cgroup memory limit: /sys/fs/cgroup is not a cgroup v2 hierarchy"
    user = os.getuid() != 0
    argv = (systemd_run, *(("--user",) if user else ()), "--scope", "--quiet", "--collect")
    env = {
        key: os.environ[key]
        for key in ("XDG_RUNTIME_DIR", "DBUS_SESSION_BUS_ADDRESS")
        if key in os.environ
    }
    cgroup = MemoryCgroup(argv, env, "a systemd scope per task (MemoryMax)")
    probe = [*cgroup.prefix(_PROBE_MB), "sh", "-c", _READ_OWN_MAX]
    try:
        done = subprocess.run(
            probe,
            capture_output=True,
            timeout=10,
            check=False,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **env},
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"no cgroup memory limit: `systemd-run` failed ({exc})"
    if done.returncode != 0 or done.stdout.strip() != str(_PROBE_MB * MB).encode():
        said = (done.stderr or done.stdout).decode(errors="replace").strip().splitlines()
        why = said[0][:200] if said else f"exit {done.returncode}"
        return None, f"no cgroup memory limit: no systemd manager set MemoryMax ({why})"
    return cgroup, f"cgroup memory limit in force: {cgroup.mechanism}"
