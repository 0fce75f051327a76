"""`tally stop` when the daemon's socket does not answer (removed by a tmp cleaner, or the
wrong path given): the daemon holding the state dir's ledger lock is sent SIGTERM and drains
as on Ctrl-C. A lock whose pid names some other process is never signalled."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from surfaces.cli.service import lock_holder
from tests.interpreter import FAR_ROSTER as ROSTER
from tests.interpreter import ROOT, tally_env
from tests.interpreter import tally_run as _tally


def test_stop_falls_back_to_the_ledger_lock_when_the_socket_is_gone(tmp_path: Path) -> None:
    roster = tmp_path / "roster.toml"
    roster.write_text(ROSTER)
    sock = tmp_path / "run" / "tally.sock"
    daemon = subprocess.Popen(
        [sys.executable, "-m", "surfaces", "serve", "--roster", str(roster)],
        env=tally_env(tmp_path),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while not sock.exists() or lock_holder(tmp_path / "state") is None:
            assert daemon.poll() is None, "the daemon exited"
            assert time.monotonic() < deadline, "the daemon did not start"
            time.sleep(0.1)
        assert lock_holder(tmp_path / "state") == daemon.pid
        sock.unlink()  # what a tmp cleaner does to /run/user/…: the daemon lives on, unreachable
        stop = _tally(tmp_path, "stop")
        assert stop.returncode == 0, stop.stderr
        assert f"sending SIGTERM to pid {daemon.pid}" in stop.stderr, stop.stderr
        assert stop.stderr.rstrip().endswith("tally: stopped"), stop.stderr
        assert daemon.wait(10) == 0  # a clean stop, as on Ctrl-C
        assert (tmp_path / "state" / "ledger" / "checkpoint").exists()
        again = _tally(tmp_path, "stop")
        assert again.returncode == 0
        assert "no daemon running" in again.stderr
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()


def test_a_lock_naming_another_process_is_not_signalled(tmp_path: Path) -> None:
    # The lock is held (by this test) but names a live process that does not hold it.
    import fcntl

    ledger = tmp_path / "state" / "ledger"
    ledger.mkdir(parents=True)
    bystander = subprocess.Popen(["sleep", "30"])
    try:
        fd = os.open(ledger / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, f"{bystander.pid}\n".encode())
        assert lock_holder(tmp_path / "state") is None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        assert lock_holder(tmp_path / "state") == os.getpid()  # the holder itself is found
        os.close(fd)
        stop = _tally(tmp_path, "stop", "--timeout", "2")
        assert stop.returncode == 0, stop.stderr
        assert "no daemon running" in stop.stderr
        assert bystander.poll() is None  # never signalled
    finally:
        bystander.kill()
        bystander.wait()


def test_a_hung_daemon_is_signalled_and_stop_says_what_is_left(tmp_path: Path) -> None:
    # A daemon that accepts but never answers (here: SIGSTOP) once left `tally stop` waiting
    # for ever. It is asked for a while, then sent SIGTERM through its lock; still there after
    # --timeout, stop says so (exit 1, `kill -KILL`). Once it runs again it stops cleanly.
    import signal

    roster = tmp_path / "roster.toml"
    roster.write_text(ROSTER)
    sock = tmp_path / "run" / "tally.sock"
    daemon = subprocess.Popen(
        [sys.executable, "-m", "surfaces", "serve", "--roster", str(roster)],
        env=tally_env(tmp_path),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while not sock.exists() or lock_holder(tmp_path / "state") is None:
            assert daemon.poll() is None, "the daemon exited"
            assert time.monotonic() < deadline, "the daemon did not start"
            time.sleep(0.1)
        os.kill(daemon.pid, signal.SIGSTOP)
        started = time.monotonic()
        stop = _tally(tmp_path, "stop", "--timeout", "2")
        assert time.monotonic() - started < 30
        assert stop.returncode == 1, stop.stderr
        assert f"sending SIGTERM to pid {daemon.pid}" in stop.stderr, stop.stderr
        assert f"kill -KILL {daemon.pid}" in stop.stderr, stop.stderr
        os.kill(daemon.pid, signal.SIGCONT)
        assert daemon.wait(30) == 0  # the SIGTERM it was sent: a clean stop
    finally:
        if daemon.poll() is None:
            os.kill(daemon.pid, signal.SIGCONT)
            daemon.kill()
            daemon.wait()
