"""What runs a task: a chat prompt for the pool, a command (never through a shell), a stub.

The chat executor's model call goes through `calls` (which leases, witnesses and meters
it); this module builds its messages. The command executor is self-contained.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import tempfile
import time
import warnings
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from daemon import record as rec
from daemon.runs import limits, sandbox, seccomp
from daemon.runs.limits import DiskQuota, DiskUsage, TmpfsProbe, disk_usage
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
    limit: str | None = None
    """The limit the task ran into (disk quota, a full in-memory dir), naming its setting."""

    def body(self, task: str) -> rec.CommandRun:
        body = rec.CommandRun(
            task=task,
            argv=list(self.argv),
            exit_code=self.exit_code,
            timed_out=self.timed_out,
            stdout=self.stdout,
            stderr=self.stderr,
            truncated=self.truncated,
            duration_ms=self.duration_ms,
        )
        if self.limit is not None:  # only then: a body without one keeps its bytes
            body.limit = self.limit
        return body


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
    set_env: Mapping[str, str] | None = None,
) -> CommandOutcome:
    """Run `argv` (no shell: metacharacters are literal arguments) in a fresh temporary dir,
    or in `workdir` (a task's view: bound into the sandbox as its only writable dir, and left
    in place afterwards).

    The child runs confined as `daemon.runs.sandbox` says (bubblewrap unless the roster opted
    out), gets only the allow-listed environment and its own process group (so a timeout or a
    cancellation kills everything it started), and at most `output_cap` bytes of each stream
    are kept. While it runs, its dir's disk quota and its tmpfs inodes are watched
    (`daemon.runs.limits`): past one, it is killed; past one or with a tmpfs full at its end,
    the outcome's `limit` names it (a view's quota is what the task may add to what it held).
    The temporary dir is removed afterwards, off the event loop; a view is left in place.
    """
    if not argv:
        raise ValueError("a command task needs a non-empty argv")
    policy = policy or CommandPolicy()
    confinement = confinement or Confinement()
    env = {key: os.environ[key] for key in env_allow if key in os.environ}
    env.update(set_env or {})  # an agent CLI's configured values (`daemon.runs.agentcli`)
    # The dir and the sandbox's arguments (realpaths, existence checks) cost file-system calls:
    # made in a worker thread, in one hop, as the dir is removed.
    own = workdir is None
    if workdir is None:
        workdir = await asyncio.to_thread(_make_workdir, confinement)
        base = DiskUsage(0, 0, complete=True)
    else:  # a view: what it held before the task is the project's, not the task's
        base = await asyncio.to_thread(disk_usage, workdir)
    sandboxed = policy.sandbox == "bwrap"
    info = _InfoPipe() if sandboxed else None
    filter_fd = seccomp.pipe() if sandboxed else None
    removed = False
    cgroup = confinement.memory_cgroup if sandboxed else None
    try:
        env.setdefault("HOME", str(workdir))  # an agent CLI's `set_env` gives its own
        env.setdefault("TMPDIR", str(workdir))
        wrapped = await asyncio.to_thread(
            sandbox.wrap,
            argv,
            policy=policy,
            workdir=workdir,
            env=env,
            network=network,
            hidden=confinement.hidden,
            info_fd=info.write if info is not None else None,
            memory_cgroup=cgroup,
            seccomp_fd=filter_fd,
        )
        watch = _Watch(
            # A view's quota is what the task may add to what the view held before it.
            quota=DiskQuota(
                workdir, base.bytes + policy.disk_mb * MB, base.entries + policy.disk_files
            ),
            probe=TmpfsProbe(
                sandbox.tmpfs_sizes(policy), policy.disk_files, memory_mb=policy.memory_mb
            )
            if sandboxed
            else None,
            info=info,
            memory_max_mb=policy.memory_mb if cgroup is not None else None,
            seccomp_fd=filter_fd,
        )
        launch_env = env | dict(cgroup.env) if cgroup is not None else env
        outcome = await _supervise(
            list(argv), wrapped, workdir, launch_env, timeout_s, output_cap, stdin, watch
        )
        # The dir's last measure (a task that filled it and ended between two ticks) and its
        # removal share one hop to a worker thread; a view stays (its changes are the task's).
        if own:
            last = await asyncio.to_thread(_measure_and_remove, watch.quota)
            removed = True
        else:
            last = await asyncio.to_thread(watch.quota.check)
        return outcome if outcome.limit or not last else replace(outcome, limit=last)
    finally:
        if info is not None:
            info.close()
        if filter_fd is not None:
            with contextlib.suppress(OSError):  # closed once the child had it
                os.close(filter_fd)
        if own and not removed:
            await asyncio.to_thread(sandbox.remove_task_dir, workdir)


def _measure_and_remove(quota: DiskQuota) -> str | None:
    try:
        return quota.check()
    finally:
        sandbox.remove_task_dir(quota.directory)


MB = 1024 * 1024


class _InfoPipe:
    """The pipe bwrap writes its init's pid on (`--info-fd`): the child inherits `write`,
    which the daemon closes once the child has it, so the read end sees bwrap's EOF."""

    def __init__(self) -> None:
        self.read, self.write = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)

    def close_write(self) -> None:
        if self.write >= 0:
            os.close(self.write)
            self.write = -1

    def close(self) -> None:
        self.close_write()
        if self.read >= 0:
            os.close(self.read)
            self.read = -1


@dataclass
class _Watch:
    """What is counted while a task runs (see `daemon.runs.limits`)."""

    quota: DiskQuota
    probe: TmpfsProbe | None
    info: _InfoPipe | None
    memory_max_mb: int | None = None
    """The cgroup `MemoryMax` the task runs under, if one is in force."""
    seccomp_fd: int | None = None
    """The seccomp program bwrap reads (`--seccomp`): the child inherits it."""
    limit: str | None = None

    async def run(self, proc: asyncio.subprocess.Process) -> None:
        """Until cancelled: find the sandbox's tmpfs mounts, then check the dir's quota and
        the mounts' inodes every tick; past a limit, note it and kill the task."""

        def exceeded(message: str) -> None:
            if self.limit is None:
                self.limit = message
            _kill_group(proc)

        if self.probe is not None and self.info is not None:
            await self._attach(self.probe, self.info.read, proc)
            self.info.close()  # read once: a daemon running many tasks keeps fewer fds
        disk = asyncio.ensure_future(self.quota.watch(exceeded))
        try:
            while not disk.done():
                if self.probe is not None and (message := self.probe.over_limit()):
                    exceeded(message)
                    return
                await asyncio.wait([disk], timeout=limits.WATCH_INTERVAL_S)
        finally:
            disk.cancel()
            with contextlib.suppress(BaseException):
                await disk

    @staticmethod
    async def _attach(probe: TmpfsProbe, info_fd: int, proc: asyncio.subprocess.Process) -> None:
        """bwrap writes its init's pid on the info fd before building the sandbox: the
        mounts are looked for every millisecond until all are there (a few ms), while the
        task lives, for 2 s at most (a task that ends first leaves nothing to look at)."""
        info = b""
        pid: int | None = None
        for _ in range(2000):
            if proc.returncode is not None:
                return
            if pid is None:
                try:
                    while chunk := os.read(info_fd, 4096):
                        info += chunk
                        if len(info) > 65536:
                            return  # not bwrap's JSON
                    if not (pid := limits.read_child_pid(info)):
                        return  # closed without a pid: bwrap failed to start
                except BlockingIOError:
                    pid = limits.read_child_pid(info)
            if pid is not None and probe.attach(pid):
                return
            await asyncio.sleep(0.001)

    async def finish(self, killed: bool) -> str | None:
        """After the task ended: the limit it hit while running, or one its end shows (a
        tmpfs left full, a SIGKILL no one here sent under a cgroup memory limit: the kernel's
        OOM killer is the usual sender). The dir's last measure is `run_command`'s."""
        try:
            if self.limit is None and self.probe is not None:
                self.limit = self.probe.full()
            if self.limit is None and killed and self.memory_max_mb is not None:
                self.limit = (
                    "the task was killed by SIGKILL, most likely for passing its memory limit "
                    f"of {self.memory_max_mb} MiB (cgroup MemoryMax, [policy.command] memory_mb)"
                )
            return self.limit
        finally:
            self.close()

    def close(self) -> None:
        if self.probe is not None:
            self.probe.close()


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
    watch: _Watch,
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
        pass_fds=tuple(
            fd
            for fd in (watch.info.write if watch.info is not None else None, watch.seccomp_fd)
            if fd is not None
        ),
    )
    if watch.info is not None:
        watch.info.close_write()
    watching = asyncio.ensure_future(watch.run(proc))
    try:
        return await _await_outcome(argv, proc, started, timeout_s, output_cap, stdin, watch)
    finally:
        watching.cancel()
        with contextlib.suppress(BaseException):
            await watching
        watch.close()  # a cancelled task never reached `finish`


async def _await_outcome(
    argv: list[str],
    proc: asyncio.subprocess.Process,
    started: float,
    timeout_s: float,
    output_cap: int,
    stdin: str | None,
    watch: _Watch,
) -> CommandOutcome:
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
        limit=await watch.finish(killed=not timed_out and proc.returncode == -signal.SIGKILL),
    )


Stub = Callable[[str, str, int, Mapping[str, str]], Awaitable[str]]
"""(task id, instruction, attempt, upstream results) -> output. Tests and benchmarks inject
one (`Engine(stub=...)`) to answer the chat tasks in place of the model; never in the plan."""


async def echo_stub(task: str, instruction: str, attempt: int, upstream: Mapping[str, str]) -> str:
    """The default stub: the instruction is the output."""
    return instruction
