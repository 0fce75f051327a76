"""Command tasks in real bubblewrap cannot reach the record, the daemon or the network.

Every run here goes through the real Daemon (real ledger, real pool on the scripted fake model
server, which no command task needs) and a real `bwrap`.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from daemon.errors import InvalidInput
from daemon.runs import entries as k
from daemon.runs.sandbox import (
    MB,
    TASK_NICENESS,
    SandboxUnavailable,
    python_prefixes,
    task_nofile,
    tasks_root,
    tmpfs_sizes,
)
from daemon.service import Daemon
from tests.runs.model_server import ScriptedServer, roster_toml, settings_for

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")

Make = Callable[..., Any]


@pytest.fixture
async def sandboxed(tmp_path: Path) -> AsyncIterator[Make]:
    """sandboxed(command_policy_toml, state_dir=None) -> a started Daemon."""
    made: list[tuple[Daemon, ScriptedServer]] = []

    async def make(command: str = "", **over: Any) -> Daemon:
        server = ScriptedServer([], default="done")
        await server.start()
        roster = roster_toml(server.url) + f"\n[policy.command]\n{command}\n"
        daemon = Daemon(settings_for(tmp_path, roster, **over))
        await daemon.start()
        made.append((daemon, server))
        return daemon

    yield make
    for daemon, server in made:
        await daemon.stop()
        await server.stop()


def command_plan(*argv: str, **task: Any) -> dict[str, Any]:
    return {
        "tasks": [
            {"id": "t", "lane": "backend", "instruction": "run", "executor": "command"}
            | {"argv": list(argv)}
            | task
        ]
    }


async def run(daemon: Daemon, *argv: str, **task: Any) -> dict[str, Any]:
    """Run one command task to its end; its witnessed `command.run` body."""
    view = await daemon.engine.submit("sandbox probe", plan=command_plan(*argv, **task))
    await daemon.engine.wait(view.id, timeout=30)
    entries = await daemon.ledger.entries(start=0, limit=1000, kind=k.COMMAND_RUN, run=view.id)
    assert entries, "no command.run witnessed"
    assert entries[-1].body is not None
    body = (await daemon.ledger.body(entries[-1].body)).value
    assert isinstance(body, dict)
    return body


def sh(script: str) -> list[str]:
    return ["sh", "-c", script]


async def test_the_record_and_the_daemon_are_out_of_reach(sandboxed: Make) -> None:
    daemon = await sandboxed()
    state = daemon.settings.state_dir
    (state / "http.token").write_text("SECRET-TOKEN\n")
    key = state / "ledger" / "checkpoint.key"
    assert key.exists()
    probes = {
        "key": f"cat {key}",
        "token": f"cat {state / 'http.token'}",
        "environ": f"cat /proc/{os.getpid()}/environ",
        "write": f"echo evil > {state / 'ledger' / 'evil'}",
        "socket": f"ls {daemon.settings.runtime_dir}",
    }
    for name, script in probes.items():
        body = await run(daemon, *sh(script))
        assert body["exit_code"] != 0, (name, body)
        assert "SECRET" not in body["stdout"], name
        assert "BEGIN" not in body["stdout"], name
    assert not (state / "ledger" / "evil").exists()
    # of the home dir, only the path down to the Python install is there (pyenv, a venv)
    home = await run(daemon, *sh(f"ls -A {Path.home()}"))
    under_home = {
        Path(p).relative_to(Path.home()).parts[0]
        for p in python_prefixes()
        if Path(p).is_relative_to(Path.home())
    }
    assert set(home["stdout"].split()) <= under_home
    # its /proc is its own PID namespace: the daemon's pid is not there
    listing = await run(daemon, *sh("ls /proc"))
    pids = {int(p) for p in listing["stdout"].split() if p.isdigit()}
    assert os.getpid() not in pids
    assert max(pids) < 50
    # the root filesystem is read-only; the task dir is writable
    ro = await run(daemon, *sh("touch /usr/tally-probe || exit 3; echo ok > here && cat here"))
    assert ro["exit_code"] == 3
    rw = await run(daemon, *sh("echo ok > here && cat here"))
    assert (rw["exit_code"], rw["stdout"]) == (0, "ok\n")


async def test_the_environment_is_the_allow_list(
    sandboxed: Make, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SANDBOX_CANARY", "leaked")
    daemon = await sandboxed()
    body = await run(daemon, "env")
    names = {line.split("=", 1)[0] for line in body["stdout"].splitlines()}
    assert "SANDBOX_CANARY" not in names
    allowed = {"PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "PYTHONPATH", "HOME", "TMPDIR"}
    assert names <= allowed | {"PWD"}  # PWD: set by the sandbox's chdir


def _listener() -> socket.socket:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    return server


CONNECT = "import socket, sys; socket.create_connection(('127.0.0.1', int(sys.argv[1])), 2)"


async def test_no_network_unless_policy_and_task_allow_it(sandboxed: Make) -> None:
    listener = _listener()
    port = str(listener.getsockname()[1])
    try:
        closed = await sandboxed()
        body = await run(closed, sys.executable, "-c", CONNECT, port)
        assert body["exit_code"] != 0
        with pytest.raises(InvalidInput, match="network"):
            await closed.engine.submit("x", plan=command_plan("true", network=True))
        await closed.stop()
        opened = await sandboxed("network = true")
        body = await run(opened, sys.executable, "-c", CONNECT, port, network=True)
        assert body["exit_code"] == 0, body["stderr"]
        body = await run(opened, sys.executable, "-c", CONNECT, port)  # the task did not ask
        assert body["exit_code"] != 0
    finally:
        listener.close()


def _alive(marker: str) -> bool:
    found = subprocess.run(["pgrep", "-f", marker], capture_output=True, check=False)
    return found.returncode == 0


async def _until(predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.05)
    return predicate()


def _escaper(marker: str) -> list[str]:
    """A task that leaves a `setsid` grandchild (its argv carries `marker`) and waits."""
    child = f"import time; time.sleep(300)  # {marker}"
    return sh(f"setsid {sys.executable} -c '{child}' & sleep 300")


async def test_a_setsid_grandchild_dies_on_cancel(sandboxed: Make) -> None:
    daemon = await sandboxed()
    marker = f"tally-escape-{uuid.uuid4().hex}"
    view = await daemon.engine.submit("x", plan=command_plan(*_escaper(marker)))
    assert await _until(lambda: _alive(marker)), "the grandchild never started"
    await daemon.engine.cancel(view.id)
    await daemon.engine.wait(view.id, timeout=10)
    assert await _until(lambda: not _alive(marker), 5.0), "a setsid grandchild survived cancel"


async def test_a_setsid_grandchild_dies_on_timeout(sandboxed: Make) -> None:
    daemon = await sandboxed()
    marker = f"tally-escape-{uuid.uuid4().hex}"
    body = await run(daemon, *_escaper(marker), timeout_s=1.5)
    assert body["timed_out"] is True
    assert await _until(lambda: not _alive(marker), 5.0), "a setsid grandchild survived timeout"


async def test_rlimits_bind_the_task(sandboxed: Make) -> None:
    daemon = await sandboxed("file_size_mb = 1\nmemory_mb = 256")
    big = await run(daemon, *sh("head -c 3000000 /dev/zero > big; echo $?; wc -c < big"))
    assert int(big["stdout"].split()[-1]) <= 1024 * 1024
    hog = await run(daemon, sys.executable, "-c", "x = bytearray(600 * 1024 * 1024)")
    assert hog["exit_code"] != 0
    assert "MemoryError" in hog["stderr"]


async def test_policy_turns_the_executor_off_or_limits_its_lanes(sandboxed: Make) -> None:
    off = await sandboxed("enabled = false")
    with pytest.raises(InvalidInput, match="off"):
        await off.engine.submit("x", plan=command_plan("true"))
    await off.stop()
    docs_only = await sandboxed('lanes = ["docs"]')
    with pytest.raises(InvalidInput, match="may not run commands"):
        await docs_only.engine.submit("x", plan=command_plan("true"))
    view = await docs_only.engine.submit("x", plan=command_plan("true", lane="docs"))
    assert (await docs_only.engine.wait(view.id, timeout=10)).state == "done"


async def test_without_bwrap_commands_are_refused_naming_the_fix(
    sandboxed: Make, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    daemon = await sandboxed()
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(SandboxUnavailable, match="apt-get install bubblewrap"):
        await daemon.engine.submit("x", plan=command_plan("true"))


async def test_tasks_run_nicer_than_the_daemon(sandboxed: Make) -> None:
    """A busy task yields the CPU to the daemon's event loop: it runs TASK_NICENESS steps
    nicer, sandboxed or not (`nice` with no argument prints the niceness it runs at)."""
    own = os.nice(0)
    for policy in ("", 'sandbox = "none"'):
        daemon = await sandboxed(policy)
        body = await run(daemon, "nice")
        assert int(body["stdout"]) == min(19, own + TASK_NICENESS), policy
        await daemon.stop()


async def test_running_unsandboxed_is_an_explicit_witnessed_choice(sandboxed: Make) -> None:
    daemon = await sandboxed('sandbox = "none"')
    witnessed = await daemon.ledger.entries(start=0, limit=100, kind="policy.unsandboxed")
    assert len(witnessed) == 1
    body = await run(daemon, *sh("echo unconfined"))
    assert body["stdout"] == "unconfined\n"


@pytest.fixture
def state_in_prefix() -> Iterator[Path]:
    """A state dir inside the Python prefix the sandbox binds (removed after the daemon)."""
    state = Path(tempfile.mkdtemp(prefix="tally-state-", dir=sys.prefix))
    yield state
    shutil.rmtree(state, ignore_errors=True)


async def test_a_state_dir_inside_an_allowed_dir_is_covered(
    state_in_prefix: Path, sandboxed: Make
) -> None:
    state = state_in_prefix
    daemon = await sandboxed(state_dir=state)
    body = await run(daemon, *sh(f"ls {state}/ledger; cat {state}/ledger/checkpoint.key"))
    assert body["exit_code"] != 0
    assert "BEGIN" not in body["stdout"]


async def test_binds_that_would_expose_the_state_dir_are_refused(
    sandboxed: Make, tmp_path: Path
) -> None:
    daemon = await sandboxed(f'ro_binds = ["{tmp_path}"]')
    with pytest.raises(InvalidInput, match="expose"):
        await daemon.engine.submit("x", plan=command_plan("true"))


async def test_task_dirs_left_by_a_killed_daemon_are_removed_at_start(
    sandboxed: Make, tmp_path: Path
) -> None:
    root = tasks_root(tmp_path / "state")
    stale = root / "tally-task-leftover"
    stale.mkdir(parents=True)
    (stale / "output").write_text("x")
    await sandboxed()
    assert not stale.exists()


async def test_a_python_install_under_tmp_stays_visible(
    sandboxed: Make, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A venv in /tmp (a CI clone) is bound on top of the sandbox's empty /tmp, not under it."""
    prefix = tmp_path / "venv"
    prefix.mkdir()
    (prefix / "marker").write_text("here")
    # the daemon's own interpreter stays bound: the sandbox's seccomp filter is loaded by it
    own = python_prefixes()
    monkeypatch.setattr("daemon.runs.sandbox.python_prefixes", lambda: (*own, str(prefix)))
    daemon = await sandboxed()
    body = await run(daemon, "cat", str(prefix / "marker"))
    assert (body["exit_code"], body["stdout"]) == (0, "here")


async def run_to_end(daemon: Daemon, *argv: str, **task: Any) -> tuple[Any, dict[str, Any]]:
    """The finished run's view and its witnessed `command.run` body."""
    view = await daemon.engine.submit("sandbox probe", plan=command_plan(*argv, **task))
    done = await daemon.engine.wait(view.id, timeout=30)
    entries = await daemon.ledger.entries(start=0, limit=1000, kind=k.COMMAND_RUN, run=view.id)
    assert entries
    assert entries[-1].body is not None
    body = (await daemon.ledger.body(entries[-1].body)).value
    assert isinstance(body, dict)
    return done, body


FILL = "head -c 200000000 /dev/zero > {path}; echo $?; stat -c %s {path}"


@pytest.mark.parametrize("mount", ["/tmp", "/dev/shm", "/run"])
async def test_an_in_memory_dir_holds_its_share_of_memory_mb(sandboxed: Make, mount: str) -> None:
    """Each tmpfs is sized from `memory_mb`: a fill gets ENOSPC inside at that size (so the host
    holds no more), and the task fails naming the limit and where it is set."""
    daemon = await sandboxed("memory_mb = 64\nfile_size_mb = 1024")
    size = tmpfs_sizes(daemon.roster.policy.command)[mount]
    done, body = await run_to_end(daemon, *sh(FILL.format(path=f"{mount}/fill")))
    assert "No space left on device" in body["stderr"], body
    status, written = body["stdout"].split()
    assert status != "0"
    assert int(written) <= size < 64 * MB
    assert done.state == "failed"
    error = done.task("t").error
    for named in (mount, "tmpfs_mb", "memory_mb"):
        assert named in error, error
    assert body["limit"] == error.split(": ", 1)[1]


HOLD_UNCOUNTED = r"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
held = 0
try:
    for i in range(40):  # 400 MiB in memfds, each file under RLIMIT_FSIZE
        fd = os.memfd_create("x")
        for j in range(10):
            os.write(fd, bytes(1 << 20))
            held += 1
except OSError as err:
    print("memfd", err.errno)
for call, args in (("shmget", (0, 10 << 20, 0o1600)), ("msgget", (0, 0o1600))):
    print(call, getattr(libc, call)(*args), ctypes.get_errno())
print("held", held)
"""


async def test_memory_no_limit_counts_is_refused(sandboxed: Make) -> None:
    """memfd files, System V shared memory (it outlives its detach) and message queues count
    against no tmpfs size and no RLIMIT_AS: with memory_mb = 64 a task held 400 MiB each way.
    The sandbox's seccomp filter refuses them (EPERM)."""
    daemon = await sandboxed("memory_mb = 64\nfile_size_mb = 1024")
    _, body = await run_to_end(daemon, sys.executable, "-c", HOLD_UNCOUNTED)
    lines = body["stdout"].split("\n")
    assert "memfd 1" in lines, body
    assert "shmget -1 1" in lines, body
    assert "msgget -1 1" in lines, body
    assert "held 0" in lines, body


SOCKET_BUFFERS = r"""
import resource, socket
pairs, queued = [], 0
try:
    for i in range(3000):
        a, b = socket.socketpair()
        a.setblocking(False)
        pairs.append((a, b))
        try:
            while True:
                queued += a.send(bytes(65536))
        except BlockingIOError:
            pass
except OSError as err:
    print("stopped", err.errno)
print("nofile", resource.getrlimit(resource.RLIMIT_NOFILE)[0], "queued", queued)
"""


async def test_descriptors_are_bounded_by_memory_mb(sandboxed: Make) -> None:
    """Socket buffers are kernel memory no tmpfs size, rlimit or PSS counts, one per descriptor:
    with the daemon's raised descriptor limit inherited, 3000 socket pairs held 667 MiB under
    memory_mb = 64. A task's RLIMIT_NOFILE is memory_mb / 512 KiB (at least 256)."""
    daemon = await sandboxed("memory_mb = 64\nfile_size_mb = 1024")
    _, body = await run_to_end(daemon, sys.executable, "-c", SOCKET_BUFFERS)
    out = body["stdout"].split()
    assert out[:2] == ["stopped", str(errno.EMFILE)], body
    assert int(out[out.index("nofile") + 1]) == task_nofile(daemon.roster.policy.command) == 256
    assert int(out[out.index("queued") + 1]) < 64 * MB


FORK_FILL = r"""
import os, time
for i in range(30):
    if os.fork() == 0:
        b = bytearray(30 << 20)  # under each process's RLIMIT_AS, touched
        time.sleep(5)
        os._exit(0)
time.sleep(5)
print("held 900 MiB")
"""


async def test_forks_that_fill_are_killed_at_memory_mb_naming_it(sandboxed: Make) -> None:
    """RLIMIT_AS binds each process: 30 forks of 30 MiB held 900 MiB under memory_mb = 64.
    Without a cgroup, the watch sums the sandbox's anonymous memory (PSS) and its tmpfs use."""
    daemon = await sandboxed("memory_mb = 64\nfile_size_mb = 1024")
    if daemon.engine.options.confinement.memory_cgroup is not None:
        pytest.skip("a cgroup MemoryMax bounds the task here (the kernel kills it)")
    done, body = await run_to_end(daemon, sys.executable, "-c", FORK_FILL)
    assert "held 900" not in body["stdout"]
    assert done.state == "failed"
    error = done.task("t").error
    assert "over its memory_mb of 64 MiB" in error, error


async def test_no_unsized_or_resizable_tmpfs_is_left_writable(sandboxed: Make) -> None:
    """The root and /dev are read-only, a sized tmpfs cannot be remounted larger, and a task
    cannot mount a fresh tmpfs in a user namespace of its own (as root or not)."""
    daemon = await sandboxed("memory_mb = 64")
    probes = {
        "root": "echo x > /fill",
        "dev": "echo x > /dev/fill",
        "remount": "mount -o remount,size=1g /tmp",
        "userns": "unshare -Urm sh -c 'mount -t tmpfs none /tmp && echo x > /tmp/fill'",
    }
    for name, script in probes.items():
        body = await run(daemon, *sh(script))
        assert body["exit_code"] != 0, (name, body)
    sizes = await run(daemon, *sh("stat -f -c '%b %S' /tmp"))
    blocks, block = sizes["stdout"].split()
    assert int(blocks) * int(block) == tmpfs_sizes(daemon.roster.policy.command)["/tmp"]


async def test_a_task_over_its_disk_quota_is_killed_naming_it(sandboxed: Make) -> None:
    """Files in the task's own (on-disk) dir count against `disk_mb` in total: the writer is
    killed soon after it passes the quota, and the task fails naming it."""
    daemon = await sandboxed("disk_mb = 8")
    # 1 MiB files, one after the other, each counted on stdout once written
    writer = (
        "i=0; while [ $i -lt 400 ]; do head -c 1048576 /dev/zero > f$i; i=$((i+1)); echo $i; done"
    )
    done, body = await run_to_end(daemon, *sh(writer))
    written = [int(n) for n in body["stdout"].split()]
    assert written, body
    assert 8 <= written[-1] < 400, "the writer was not stopped"
    assert written[-1] <= 8 + 24, f"{written[-1]} MiB written against a quota of 8"
    assert body["exit_code"] == -signal.SIGKILL
    assert done.state == "failed"
    assert "disk quota of 8 MiB" in done.task("t").error
    assert "disk_mb" in done.task("t").error
    # one file is capped at the quota by RLIMIT_FSIZE, whatever the watcher's pace
    one = await run(daemon, *sh("head -c 20000000 /dev/zero > big; stat -c %s big"))
    assert int(one["stdout"].split()[-1]) <= 8 * MB


async def test_a_task_that_fills_its_dir_and_exits_at_once_still_fails(sandboxed: Make) -> None:
    daemon = await sandboxed("disk_mb = 2")
    done, _ = await run_to_end(
        daemon, *sh("for i in 1 2 3; do head -c 1048576 /dev/zero > f$i; done")
    )
    assert done.state == "failed"
    assert "disk quota of 2 MiB" in done.task("t").error


async def test_too_many_files_is_a_limit_too(sandboxed: Make) -> None:
    """Empty files cost no blocks but an inode each (kernel memory a tmpfs size does not
    count): in the task dir and in /tmp alike, `disk_files` bounds them."""
    daemon = await sandboxed("disk_files = 500")
    many = "i=0; while [ $i -lt 20000 ]; do : > {dir}/f$i || exit 7; i=$((i+1)); done; sleep 20"
    for where in (".", "/tmp"):
        done, body = await run_to_end(daemon, *sh(many.format(dir=where)))
        assert done.state == "failed", body
        error = done.task("t").error
        assert "quota of 500 files and dirs" in error, error
        assert "disk_files" in error, error
        assert body["duration_ms"] < 15_000


async def test_fifty_command_tasks_at_once(sandboxed: Make) -> None:
    """50 runs of one command task each, submitted together: all finish, and nothing is left
    behind (descriptors, zombies, task dirs)."""
    daemon = await sandboxed()
    root = tasks_root(daemon.settings.state_dir)
    await run(daemon, "true")  # the first task opens what the daemon keeps (loggers, pipes)
    before = _fds()
    views = await asyncio.gather(
        *(
            daemon.engine.submit(f"probe {i}", plan=command_plan(*sh(f"echo {i}; sleep 0.2")))
            for i in range(50)
        )
    )
    done = await asyncio.gather(*(daemon.engine.wait(v.id, timeout=120) for v in views))
    assert [d.state for d in done] == ["done"] * 50
    assert sorted(int(d.task("t").result) for d in done) == list(range(50))
    # the ledger opens a file per tree level as it grows: anything else left open leaked
    state = str(daemon.settings.state_dir)
    leaked = lambda: {fd for fd in _fds() - before if state not in fd}  # noqa: E731
    assert await _until(lambda: not leaked(), 5.0), leaked()
    assert _zombies() == []
    assert not [p for p in root.iterdir() if p.name.startswith("tally-task-")]
    # and 50 in one plan: they queue behind the run's max_parallel (its answer is a model
    # call, whose kept-alive connection is no leak: descriptors are counted above)
    tasks = [
        {"id": f"t{i}", "lane": "backend", "instruction": "run", "executor": "command"}
        | {"argv": ["echo", str(i)]}
        for i in range(50)
    ]
    view = await daemon.engine.submit("fifty", plan={"tasks": tasks}, max_parallel=16)
    one = await daemon.engine.wait(view.id, timeout=120)
    assert one.state == "done"
    assert [t.result for t in one.tasks] == [f"{i}\n" for i in range(50)]
    assert _zombies() == []
    assert not [p for p in root.iterdir() if p.name.startswith("tally-task-")]


def _zombies() -> list[int]:
    """Children of this process that exited and were never reaped."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if state == "Z" and int(ppid) == os.getpid():
            found.append(int(entry))
    return found


def _fds() -> set[str]:
    """This process's descriptors, each as 'number:target'."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor, gone
            out.add(f"{fd}:{os.readlink(f'/proc/self/fd/{fd}')}")
    return out


DEEP = """
import os
for _ in range(25):  # 25 * 201 bytes > PATH_MAX
    os.mkdir("d" * 200)
    os.chdir("d" * 200)
with open("hidden", "wb") as f:
    f.write(bytes(1 << 20))
"""


async def test_a_tree_nested_past_path_max_fails_and_is_removed(sandboxed: Make) -> None:
    """Dirs nested past PATH_MAX cannot be measured by path: the task fails naming its quota,
    and its dir is still removed."""
    daemon = await sandboxed()
    root = tasks_root(daemon.settings.state_dir)
    done, body = await run_to_end(daemon, sys.executable, "-c", DEEP)
    assert done.state == "failed", body
    assert "unreadable to its disk quota check" in done.task("t").error
    assert body["exit_code"] in (0, -signal.SIGKILL)  # killed once seen, or seen at its end
    assert not [p for p in root.iterdir() if p.name.startswith("tally-task-")]
