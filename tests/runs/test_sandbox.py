"""Command tasks in real bubblewrap cannot reach the record, the daemon or the network.

Every run here goes through the real Daemon (real ledger, real pool on the scripted fake model
server, which no command task needs) and a real `bwrap`.
"""

from __future__ import annotations

import asyncio
import os
import shutil
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
from daemon.runs.sandbox import TASK_NICENESS, SandboxUnavailable, python_prefixes, tasks_root
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
    monkeypatch.setattr("daemon.runs.sandbox.python_prefixes", lambda: (str(prefix),))
    daemon = await sandboxed()
    body = await run(daemon, "cat", str(prefix / "marker"))
    assert (body["exit_code"], body["stdout"]) == (0, "here")
