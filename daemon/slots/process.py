"""One model-server child process: argv from a template, own process group, captured log.

The log rotates when a server starts and, while it runs, whenever it outgrows a cap (checked on
the pool's health tick; see `copy_truncate`).

The child never outlives the daemon: it is started with PR_SET_PDEATHSIG=SIGKILL (set in the
child between fork and exec), so even a SIGKILLed daemon takes its servers with it. Stopping
signals the whole process group, in case the server command forks helpers of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

_PR_SET_PDEATHSIG = 1
_LOG_KEEP = 3
_TAIL_BYTES = 4000


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def render_argv(template: Sequence[str], values: Mapping[str, str | int]) -> list[str]:
    """Fill `{python}`, `{model}`, `{port}`, `{slots}`, `{ctx}`; other braces stay as written."""
    filled = {"{python}": sys.executable, **{f"{{{k}}}": str(v) for k, v in values.items()}}
    argv = []
    for part in template:
        for key, value in filled.items():
            part = part.replace(key, value)
        argv.append(part)
    return argv


def rotate_logs(path: Path, keep: int = _LOG_KEEP) -> None:
    """`x.log` → `x.log.1` → … → `x.log.<keep>`; the oldest is dropped."""
    for i in range(keep - 1, 0, -1):
        older = path.with_name(f"{path.name}.{i}")
        if older.exists():
            os.replace(older, path.with_name(f"{path.name}.{i + 1}"))
    if path.exists():
        os.replace(path, path.with_name(f"{path.name}.1"))


def copy_truncate(path: Path, keep: int = _LOG_KEEP) -> None:
    """Rotate the log of a server that is still writing to it: copy it to `x.log.1` (shifting
    the older ones), then truncate it in place.

    The child holds its own descriptor of `x.log`, so renaming the file would leave it writing
    into the renamed file and reopening is not ours to do. Piping its output through the daemon
    would let us reopen at will, but costs a reader task per server and makes a busy or dying
    daemon block (or SIGPIPE) the servers; copy-and-truncate needs neither. It works because
    the log is opened O_APPEND: after the truncate the child's next write lands at the new end
    (offset 0), not at its old offset behind a hole of NULs. Lines written between the copy and
    the truncate are lost; for a diagnostic log that is the accepted price.
    """
    tmp = path.with_name(f"{path.name}.rotating")
    shutil.copyfile(path, tmp)
    os.truncate(path, 0)  # straight after the copy: the window for lost lines stays short
    for i in range(keep - 1, 0, -1):
        older = path.with_name(f"{path.name}.{i}")
        if older.exists():
            os.replace(older, path.with_name(f"{path.name}.{i + 1}"))
    os.replace(tmp, path.with_name(f"{path.name}.1"))


def log_tail(path: Path, limit: int = _TAIL_BYTES) -> str:
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - limit))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


def _child_guard(parent: int) -> Callable[[], None]:
    libc = ctypes.CDLL(None, use_errno=True)  # loaded before fork: nothing to import in the child

    def guard() -> None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return guard


class ServerProcess:
    def __init__(self, argv: Sequence[str], log_path: Path, env: Mapping[str, str] | None = None):
        self.argv = list(argv)
        self.log_path = log_path
        self.env = dict(env) if env is not None else None
        self._proc: asyncio.subprocess.Process | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode if self._proc else None

    async def spawn(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        rotate_logs(self.log_path)
        with self.log_path.open("ab") as log:
            self._proc = await asyncio.create_subprocess_exec(
                *self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_child_guard(os.getpid()),
                env=self.env,
            )

    async def wait(self) -> int:
        assert self._proc is not None
        return await self._proc.wait()

    def _signal_group(self, sig: int) -> None:
        if self._proc is None or self._proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, sig)

    def kill(self) -> None:
        self._signal_group(signal.SIGKILL)

    async def terminate(self, grace_s: float = 5.0) -> int | None:
        """SIGTERM the group, wait up to `grace_s`, then SIGKILL it; returns the exit code."""
        if self._proc is None:
            return None
        self._signal_group(signal.SIGTERM)
        try:
            async with asyncio.timeout(grace_s):
                await self._proc.wait()
        except TimeoutError:
            self.kill()
            await self._proc.wait()
        # reap helpers the server may have left in its group
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, signal.SIGKILL)
        return self._proc.returncode

    def tail(self) -> str:
        return log_tail(self.log_path)

    def rotate_if_over(self, max_bytes: int, keep: int = _LOG_KEEP) -> bool:
        """Copy-truncate the log if it has grown past `max_bytes` (blocking file I/O: run it
        in a thread); True if it rotated."""
        try:
            if self.log_path.stat().st_size <= max_bytes:
                return False
            copy_truncate(self.log_path, keep)
        except OSError:
            return False  # a log we cannot rotate must not take the server down
        return True
