"""systemd: the units verify, the system unit's exposure is low, sd_notify arrives in order."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from surfaces.units import PLACEHOLDER, system_unit, user_unit

ROOT = Path(__file__).resolve().parents[2]
needs_systemd = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed"
)


def test_unit_files_match_the_generator() -> None:
    assert (ROOT / "systemd/tallyd.service").read_text() == user_unit()
    assert (ROOT / "systemd/tallyd-system.service").read_text() == system_unit()


def _copy(tmp_path: Path, text: str, name: str = "tallyd.service") -> Path:
    # systemd-analyze checks that ExecStart exists: point the copy at a real executable.
    path = tmp_path / name
    path.write_text(text.replace(PLACEHOLDER, sys.executable))
    return path


@needs_systemd
def test_user_unit_verifies(tmp_path: Path) -> None:
    unit = _copy(tmp_path, user_unit())
    (tmp_path / "run").mkdir()
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path / "run"), "HOME": str(tmp_path)}
    proc = subprocess.run(
        ["systemd-analyze", "--user", "verify", str(unit)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    # A user manager cannot set up mount namespaces or IP filters, so a user unit scores
    # higher (worse) than the system one; seccomp-based options must still be there. The
    # namespaces bubblewrap needs for command tasks cost 0.9 (6.4 -> 7.3).
    proc = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", "--threshold=75", str(unit)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:]


@needs_systemd
def test_system_unit_verifies_and_is_hardened(tmp_path: Path) -> None:
    unit = _copy(tmp_path, system_unit())
    proc = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr
    proc = subprocess.run(
        # 1.3 before the command sandbox; its namespaces and mount calls bring it to 2.3, and
        # allowing @resources (nice for command tasks) to 2.4.
        ["systemd-analyze", "security", "--offline=true", "--threshold=25", str(unit)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:]


SPAWNED_ROSTER = """version = 1
[[models]]
name = "tiny"
command = ["{python}", "-m", "tests.slots.fake_server", "--port", "{port}"]

[tiers]
ladder = ["cheap"]
cheap = ["tiny"]

[[lanes]]
name = "backend"
keywords = ["api"]
tier = "cheap"
system = "b"
"""


def test_sd_notify_ready_watchdog_stopping_in_order(tmp_path: Path) -> None:
    """`tally serve` itself (real daemon; the pool is lazy, so no model server starts)."""
    notify = tmp_path / "notify.sock"
    sock_path = tmp_path / "run" / "tally.sock"
    roster = tmp_path / "roster.toml"
    roster.write_text(SPAWNED_ROSTER)
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as listener:
        listener.bind(str(notify))
        listener.settimeout(15)
        env = {
            **os.environ,
            "NOTIFY_SOCKET": str(notify),
            "WATCHDOG_USEC": "200000",
            "PYTHONPATH": str(ROOT),
            "TALLY_STATE_DIR": str(tmp_path / "state"),
            "TALLY_RUNTIME_DIR": str(tmp_path / "run"),
        }
        proc = subprocess.Popen(
            [sys.executable, "-m", "surfaces", "serve", "--roster", str(roster)],
            env=env,
            cwd=ROOT,
        )
        try:
            messages: list[str] = []
            messages.append(listener.recv(4096).decode())
            assert messages[0].startswith("READY=1")
            # READY only once the socket listens, born 0600.
            assert sock_path.stat().st_mode & 0o777 == 0o600
            with socket.socket(socket.AF_UNIX) as probe:
                probe.connect(str(sock_path))
            while not any(m == "WATCHDOG=1" for m in messages):
                messages.append(listener.recv(4096).decode())
            proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 10
            while "STOPPING=1" not in messages and time.monotonic() < deadline:
                messages.append(listener.recv(4096).decode())
            assert proc.wait(10) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    kinds = [m.split("\n")[0] for m in messages]
    assert kinds[0] == "READY=1"
    assert kinds.index("WATCHDOG=1") > 0
    assert kinds[-1] == "STOPPING=1"
    assert not sock_path.exists()
    # The real daemon recovered, served and closed its ledger: it verifies offline.
    verify = subprocess.run(
        [sys.executable, "-m", "surfaces", "ledger", "verify", "--state", str(tmp_path / "state")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert verify.returncode == 0, verify.stderr


def test_units_give_the_daemon_descriptors() -> None:
    """The usual soft limit (1024) is too few for a daemon with a TCP listener; both units set
    soft and hard, so the system unit's seccomp filter (no setrlimit) costs nothing."""
    for unit in (user_unit(), system_unit()):
        assert "\nLimitNOFILE=65536\n" in unit


def _unit_from_cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`tally unit ARGS` as a user runs it (from tmp_path: relative paths become absolute)."""
    return subprocess.run(
        [sys.executable, "-m", "surfaces", "unit", *args],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )


def _exec_start(text: str) -> str:
    return next(line for line in text.splitlines() if line.startswith("ExecStart="))


@needs_systemd
def test_the_unit_carries_serve_options_and_verifies(tmp_path: Path) -> None:
    """`tally unit --roster R --tcp …`: the service is the daemon the user configured."""
    rosters = tmp_path / "my rosters"  # a space: quoted as systemd reads it back
    rosters.mkdir()
    (rosters / "roster.toml").write_text(SPAWNED_ROSTER)
    made = _unit_from_cli(
        tmp_path, "--roster", "my rosters/roster.toml", "--tcp", "127.0.0.1:8766", "--judge", "x"
    )
    assert made.returncode == 0, made.stderr
    line = _exec_start(made.stdout)
    assert f'--roster "{rosters}/roster.toml"' in line  # absolute, quoted
    assert "--tcp 127.0.0.1:8766" in line
    assert "--judge x" in line
    assert "--state ${STATE_DIRECTORY} --socket ${RUNTIME_DIRECTORY}/tally.sock" in line
    assert made.stderr == ""  # a user unit hides nothing: no warning
    unit = tmp_path / "tallyd.service"
    unit.write_text(made.stdout.replace(line.split()[0].removeprefix("ExecStart="), sys.executable))
    (tmp_path / "run").mkdir()
    env = {**os.environ, "XDG_RUNTIME_DIR": str(tmp_path / "run"), "HOME": str(tmp_path)}
    proc = subprocess.run(
        ["systemd-analyze", "--user", "verify", str(unit)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr

    # The system unit: paths its sandbox hides are named; a state dir of one's own is writable.
    made = _unit_from_cli(
        tmp_path, "--system", "--roster", "/tmp/r%1.toml", "--state", "/srv/tally $x"
    )
    assert made.returncode == 0, made.stderr
    assert "/tmp/r%1.toml is out of the system unit's reach (PrivateTmp=yes" in made.stderr
    line = _exec_start(made.stdout)
    assert '--state "/srv/tally $$x"' in line  # `$` and `%` doubled: no expansion
    assert "--roster /tmp/r%%1.toml" in line
    assert 'ReadWritePaths="/srv/tally $$x"' in made.stdout
    unit = tmp_path / "tallyd-system.service"
    unit.write_text(made.stdout.replace(line.split()[0].removeprefix("ExecStart="), sys.executable))
    proc = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr
    # A workspace root is writable too: `tally apply` writes there from the daemon.
    roots = _unit_from_cli(tmp_path, "--system", "--workspace-root", "/srv/src")
    assert roots.returncode == 0, roots.stderr
    assert "ReadWritePaths=/srv/src\n" in roots.stdout
    assert "--workspace-root /srv/src" in _exec_start(roots.stdout)
    home = _unit_from_cli(tmp_path, "--system", "--roster", "/home/someone/roster.toml")
    assert "ProtectHome=yes hides /home" in home.stderr
    bad = _unit_from_cli(tmp_path, "--tcp", "0.0.0.0:80")
    assert bad.returncode == 2
    assert "loopback" in bad.stderr
    served = _unit_from_cli(tmp_path, "--tcp", "0.0.0.0:8443", "--tls", "--host-name", "tally.lan")
    assert served.returncode == 0, served.stderr
    assert "--tcp 0.0.0.0:8443 --tls --host-name tally.lan" in served.stdout


@needs_systemd
def test_command_tasks_nice_is_not_filtered_out() -> None:
    """nice(1) needs setpriority, which systemd files under @resources: the system unit must not
    deny that set (it denies @privileged, where setpriority is not)."""

    def members(group: str) -> set[str]:
        proc = subprocess.run(
            ["systemd-analyze", "syscall-filter", group], capture_output=True, text=True, check=True
        )
        return {w.strip() for w in proc.stdout.splitlines() if w[:1] == " " and "#" not in w}

    resources = members("@resources")
    assert "setpriority" in resources
    assert "setpriority" not in members("@privileged")
    assert "@resources" in members("@system-service")  # allowed by both units' allow-list
    denied = [
        line.removeprefix("SystemCallFilter=~").split()
        for line in system_unit().splitlines()
        if line.startswith("SystemCallFilter=~")
    ]
    assert denied == [["@privileged"]]
    assert not any(line.startswith("SystemCallFilter=~") for line in user_unit().splitlines())
