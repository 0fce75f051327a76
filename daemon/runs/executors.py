"""What runs a task: a chat prompt for the pool, a command (never through a shell), a stub.

The chat executor's model call goes through `calls` (which leases, witnesses and meters
it); this module builds its messages. The command executor is self-contained.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
import tempfile
import time
import warnings
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from daemon.runs import sandbox
from daemon.runs.sandbox import Confinement
from roster.models import CommandPolicy

UPSTREAM_CHARS = 4000
"""Each upstream result passed to a dependant is cut to this many characters…"""
UPSTREAM_TOTAL = 12000
"""…and all of them together to this many, so prompts stay bounded however wide the DAG."""
OUTPUT_CAP = 64 * 1024
ENV_ALLOW = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "PYTHONPATH", "SYSTEMROOT")


def clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 14] + "\n…[truncated]"


def upstream_block(results: Mapping[str, str]) -> str:
    """The results of the tasks a task needs, bounded in size."""
    if not results:
        return ""
    per = max(200, min(UPSTREAM_CHARS, UPSTREAM_TOTAL // len(results)))
    parts = [f"## Result of {tid}\n{clip(text, per)}" for tid, text in results.items()]
    return "\n\n".join(parts)


def chat_messages(
    system: str,
    instruction: str,
    upstream: Mapping[str, str],
    feedback: Sequence[str],
    previous: str | None = None,
) -> list[dict[str, Any]]:
    """A task's prompt: lane system prompt first (a stable prefix keeps the slot cache warm)."""
    parts = [instruction]
    block = upstream_block(upstream)
    if block:
        parts.append("Results of earlier tasks you can use:\n\n" + block)
    if feedback:
        tried = f"\n\nYour previous answer was:\n{clip(previous, 1500)}" if previous else ""
        parts.append(
            "A previous attempt at this task failed these checks:\n- "
            + "\n- ".join(feedback)
            + tried
            + "\n\nAnswer again so that every check passes."
        )
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": "\n\n".join(parts)},
    ]


@dataclass(frozen=True)
class CommandOutcome:
    argv: list[str]
    exit_code: int | None
    stdout: str
    stderr: str
    timed_out: bool
    truncated: bool
    duration_ms: int

    def body(self, task: str) -> dict[str, Any]:
        return {
            "task": task,
            "argv": self.argv,
            "exit_code": self.exit_code,
            "timed_out": self.timed_out,
            "stdout": self.stdout,
            "stderr": self.stderr,
            "truncated": self.truncated,
            "duration_ms": self.duration_ms,
        }


async def _read_capped(stream: asyncio.StreamReader, cap: int) -> tuple[bytes, bool]:
    kept = bytearray()
    truncated = False
    while chunk := await stream.read(65536):
        room = cap - len(kept)
        if room > 0:
            kept.extend(chunk[:room])
        if len(chunk) > room:
            truncated = True  # keep draining so the child never blocks on a full pipe
    return bytes(kept), truncated


def _kill_group(proc: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


async def run_command(
    argv: Sequence[str],
    *,
    policy: CommandPolicy | None = None,
    confinement: Confinement | None = None,
    network: bool = False,
    timeout_s: float = 60.0,
    output_cap: int = OUTPUT_CAP,
    env_allow: Sequence[str] = ENV_ALLOW,
    stdin: str | None = None,
    workdir: Path | None = None,
) -> CommandOutcome:
    """Run `argv` (no shell: metacharacters are literal arguments) in a fresh temporary dir,
    or in `workdir` (a task's view: bound into the sandbox as its only writable dir, and left
    in place afterwards).

    The child runs confined as `daemon.runs.sandbox` says (bubblewrap unless the roster opted
    out), gets only the allow-listed environment and its own process group (so a timeout or a
    cancellation kills everything it started), and at most `output_cap` bytes of each stream
    are kept. The temporary dir is removed afterwards, off the event loop.
    """
    if not argv:
        raise ValueError("a command task needs a non-empty argv")
    policy = policy or CommandPolicy()
    confinement = confinement or Confinement()
    env = {key: os.environ[key] for key in env_allow if key in os.environ}
    # The dir and the sandbox's arguments (realpaths, existence checks) cost file-system calls:
    # made in a worker thread, in one hop, as the dir is removed.
    own = workdir is None
    if workdir is None:
        workdir = await asyncio.to_thread(_make_workdir, confinement)
    try:
        env["HOME"] = env["TMPDIR"] = str(workdir)
        wrapped = await asyncio.to_thread(
            sandbox.wrap,
            argv,
            policy=policy,
            workdir=workdir,
            env=env,
            network=network,
            hidden=confinement.hidden,
        )
        return await _supervise(list(argv), wrapped, workdir, env, timeout_s, output_cap, stdin)
    finally:
        if own:
            await asyncio.to_thread(shutil.rmtree, workdir, True)


def _make_workdir(confinement: Confinement) -> Path:
    if confinement.tasks_root is not None:
        confinement.tasks_root.mkdir(parents=True, exist_ok=True, mode=0o700)
    return Path(tempfile.mkdtemp(prefix="tally-task-", dir=confinement.tasks_root))


class _PidfdWatcher(asyncio.AbstractChildWatcher):
    """Learns that a child exited from a pidfd polled by whichever loop spawned it.

    Python 3.11's default watcher starts a thread per child and waits for it to run: on a busy
    machine that held the event loop for tens of milliseconds per command task. The stdlib's
    own pidfd watcher binds to one loop (tests run many); this one uses the running loop.
    """

    def add_child_handler(  # type: ignore[override]  # the stub's variadic generics, loosened
        self, pid: int, callback: Callable[..., object], *args: Any
    ) -> None:
        loop = asyncio.get_running_loop()
        pidfd = os.pidfd_open(pid)
        loop.add_reader(pidfd, self._reap, loop, pid, pidfd, callback, args)

    @staticmethod
    def _reap(
        loop: asyncio.AbstractEventLoop,
        pid: int,
        pidfd: int,
        callback: Callable[..., object],
        args: tuple[Any, ...],
    ) -> None:
        loop.remove_reader(pidfd)
        os.close(pidfd)
        try:
            _, status = os.waitpid(pid, 0)
            code = os.waitstatus_to_exitcode(status)
        except ChildProcessError:  # reaped by someone else: its status is lost
            code = 255
        callback(pid, code, *args)

    def remove_child_handler(self, pid: int) -> bool:
        return False  # asyncio calls it only for watchers that track children themselves

    def attach_loop(self, loop: asyncio.AbstractEventLoop | None) -> None:
        pass  # every call uses the running loop

    def close(self) -> None:
        pass

    def is_active(self) -> bool:
        return True

    def __enter__(self) -> _PidfdWatcher:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def watch_children_with_pidfd() -> bool:
    """Use `_PidfdWatcher` for every child asyncio spawns in this process (Python 3.11 on
    Linux 5.3+; Python 3.12 already does the same by default). Returns whether pidfds are
    in use."""
    if sys.version_info >= (3, 12):
        return True
    if not hasattr(os, "pidfd_open"):
        return False
    try:
        os.close(os.pidfd_open(os.getpid()))
    except OSError:
        return False  # an older kernel, or a seccomp filter: keep the thread per child
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        asyncio.set_child_watcher(_PidfdWatcher())
    return True


async def _supervise(
    argv: list[str],
    wrapped: list[str],
    workdir: Path,
    env: dict[str, str],
    timeout_s: float,
    output_cap: int,
    stdin: str | None,
) -> CommandOutcome:
    started = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        *wrapped,
        cwd=workdir,
        env=env,
        stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    assert proc.stdout is not None
    assert proc.stderr is not None
    if stdin is not None and proc.stdin is not None:
        proc.stdin.write(stdin.encode())
        proc.stdin.close()
    readers = asyncio.ensure_future(
        asyncio.gather(_read_capped(proc.stdout, output_cap), _read_capped(proc.stderr, output_cap))
    )
    timed_out = False
    try:
        async with asyncio.timeout(timeout_s):
            (out, out_cut), (err, err_cut) = await asyncio.shield(readers)
            await proc.wait()
    except TimeoutError:
        timed_out = True
        _kill_group(proc)
        await proc.wait()
        out, out_cut, err, err_cut = b"", False, b"", False
        with contextlib.suppress(Exception):
            (out, out_cut), (err, err_cut) = await asyncio.wait_for(readers, 1.0)
    except BaseException:
        _kill_group(proc)
        readers.cancel()
        # Retrieve the gather's outcome, or asyncio logs "exception was never retrieved".
        with contextlib.suppress(BaseException):
            await readers
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(proc.wait(), 2.0)
        raise
    _kill_group(proc)  # anything it left running in its group
    return CommandOutcome(
        argv=argv,
        exit_code=None if timed_out else proc.returncode,
        stdout=out.decode(errors="replace"),
        stderr=err.decode(errors="replace"),
        timed_out=timed_out,
        truncated=out_cut or err_cut,
        duration_ms=int((time.monotonic() - started) * 1000),
    )


Stub = Callable[[str, str, int, Mapping[str, str]], Awaitable[str]]
"""(task id, instruction, attempt, upstream results) -> output. For tests and benchmarks."""


async def echo_stub(task: str, instruction: str, attempt: int, upstream: Mapping[str, str]) -> str:
    """The default stub: the instruction is the output."""
    return instruction
