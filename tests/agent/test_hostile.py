"""A model that asks for what it must not have gets a refusal or a limit, never a crash or a
leak: paths outside the view, symlinks out, secrets, special files, a 2 GB file, a fork bomb."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from daemon.runs.agent import AgentLimits
from roster.models import CommandPolicy
from tests.agent.conftest import Make, needs_bwrap
from tests.agent.model import Step

pytestmark = needs_bwrap
MODES = pytest.mark.parametrize("mode", ["native", "json"])


@MODES
async def test_paths_outside_the_view_are_refused(bench: Make, mode: str, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("outside secret")
    script = [
        Step("read_file", {"path": "/etc/shadow"}),
        Step("read_file", {"path": "../../state/ledger"}),
        Step("read_file", {"path": "link_out"}),
        Step("write_file", {"path": "dir_out/planted.txt", "content": "x"}),
        Step("edit", {"path": "link_out", "old": "outside", "new": "owned"}),
        Step("list_files", {"path": "dir_out"}),
        Step("read_file", {"path": ".env"}),
        Step("write_file", {"path": "keys/server.pem", "content": "x"}),
        Step("search", {"pattern": "TOKEN|secret"}),
        Step("list_files", {}),
        Step("read_file", {"path": "fifo"}),
        Step("read_file", {"path": "zero"}),
        Step("write_file", {"path": ".git/hooks/pre-commit", "content": "x"}),
        Step("finish", {"summary": "tried"}),
    ]
    b = await bench(script)
    view = b.view
    os.symlink(outside / "secret.txt", view / "link_out")
    os.symlink(outside, view / "dir_out")
    os.symlink("/dev/zero", view / "zero")
    os.mkfifo(view / "fifo")
    (view / ".env").write_text("TOKEN=hunter2\n")
    (view / "config.key").write_text("TOKEN=k\n")
    (view / ".git").mkdir()
    result = await b.go(mode, limits=AgentLimits(max_steps=20, wall_s=30))
    assert result.outcome == "finished"
    steps = await b.steps()
    said = {s["step"]: s["observation"] for s in steps}
    assert [s["outcome"] for s in steps[:8]] == ["error"] * 8
    assert "is absolute" in said[1]
    assert "uses '..'" in said[2]
    assert "resolves outside the project" in said[3]
    assert "resolves outside the project" in said[4]
    assert "resolves outside the project" in said[5]
    assert "resolves outside the project" in said[6]
    assert "hidden from tools" in said[7]
    assert "hidden from tools" in said[8]
    assert said[9] == "no match for 'TOKEN|secret'", "a search never reads a hidden file"
    assert ".env" not in said[10]
    assert "config.key" not in said[10]
    assert "calc.py" in said[10]
    assert "not a regular file" in said[11]
    assert "resolves outside the project" in said[12]
    assert "cannot be written" in said[13]
    assert (outside / "secret.txt").read_text() == "outside secret"
    assert sorted(p.name for p in outside.iterdir()) == ["secret.txt"]
    assert not (view / "keys").exists()
    for s in steps:
        assert "hunter2" not in s["observation"]
        assert "outside secret" not in s["observation"]


async def test_a_two_gigabyte_file_is_refused_without_being_read(bench: Make) -> None:
    script = [
        Step("read_file", {"path": "big.bin"}),
        Step("read_file", {"path": "big.bin", "start_line": 1, "end_line": 2}),
        Step("search", {"pattern": "x"}),
        Step("edit", {"path": "big.bin", "old": "a", "new": "b"}),
        Step("finish", {"summary": "done"}),
    ]
    b = await bench(script)
    os.truncate(_touch(b.view / "big.bin"), 2 * 1024**3)  # sparse: 2 GB, nothing on disk
    started = time.monotonic()
    result = await b.go("json")
    assert result.outcome == "finished"
    assert time.monotonic() - started < 10
    said = [s["observation"] for s in await b.steps()]
    assert "is 2,147,483,648 bytes" in said[0]
    assert "is 2,147,483,648 bytes" in said[1]
    assert said[2] == "no match for 'x'"
    assert "too large to edit" in said[3]


async def test_a_fork_bomb_in_run_hits_the_sandbox_limits(bench: Make) -> None:
    marker = f"agent-bomb-{os.getpid()}-{time.monotonic_ns()}"
    bomb = (
        "import os, sys, time\n"
        "for _ in range(9):\n"  # each process forks on: up to 2**9 processes, all sleeping
        "    try:\n"
        "        os.fork()\n"
        "    except OSError:\n"
        "        print('fork refused', flush=True)\n"
        "        break\n"
        "time.sleep(60)\n"
    )
    script = [
        Step("run", {"argv": ["python3", "-c", bomb, marker]}),
        Step("read_file", {"path": "calc.py"}),
        Step("finish", {"summary": "survived"}),
    ]
    b = await bench(script)
    runner = b.runner(timeout_s=3, policy=CommandPolicy(processes=64, memory_mb=512))
    started = time.monotonic()
    result = await b.go("json", runner=runner)
    assert result.outcome == "finished", "the loop goes on after the bomb"
    assert time.monotonic() - started < 30
    steps = await b.steps()
    assert steps[0]["outcome"] == "error"
    assert "timed out after" in steps[0]["observation"]
    assert "killed with everything it started" in steps[0]["observation"]
    if os.getuid() != 0:  # RLIMIT_NPROC does not bind root: the timeout and the namespace do
        assert "fork refused" in steps[0]["observation"]
    assert "return a - b" in steps[1]["observation"]
    left = [pid for pid in os.listdir("/proc") if marker.encode() in _cmdline(pid)]
    assert not left, f"processes of the bomb left running: {left}"


def _touch(path: Path) -> Path:
    path.touch()
    return path


def _cmdline(pid: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""
