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
        # 1.3 before the command sandbox; its namespaces and mount calls bring it to 2.3.
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
