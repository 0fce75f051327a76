"""Code run in a fresh interpreter of this virtualenv, from the repository root, with none of
the ambient TALLY_* variables or a systemd credential directory: what a test sees of imports
or of a start is then its own, not this process's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_fresh(
    code: str, *args: str, home: Path | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """`python -c code args…`; asserts it exited 0 (its stderr is the message otherwise)."""
    drop = ("TALLY_", "CREDENTIALS_DIRECTORY", "RUNTIME_DIRECTORY")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    if home is not None:
        env["HOME"] = str(home)  # nothing of the user's state dir or roster
        env["XDG_RUNTIME_DIR"] = str(home / "run")  # nor a running daemon's socket
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr
    return done


def tally_env(tmp_path: Path) -> dict[str, str]:
    """The environment of a `tally` process a test starts: this repository's code, and a state
    dir, runtime dir (socket) and config home under `tmp_path` (no user's daemon, no unit)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TALLY_")}
    return env | {
        "PYTHONPATH": str(ROOT),
        "TALLY_STATE_DIR": str(tmp_path / "state"),
        "TALLY_RUNTIME_DIR": str(tmp_path / "run"),
        "XDG_CONFIG_HOME": str(tmp_path / "config"),
    }


FAR_ROSTER = """version = 1
[[models]]
name = "far"
url = "http://127.0.0.1:9/v1"
slots = 1

[tiers]
ladder = ["cheap"]
cheap = ["far"]

[[lanes]]
name = "general"
keywords = ["x"]
tier = "cheap"
system = "s"
"""
"""A roster whose one member answers nowhere (port 9): a daemon that starts and serves, and
never calls a model."""


def tally_run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`tally ARGS` in a fresh process with `tally_env(tmp_path)` (its exit code is the caller's
    to check)."""
    return subprocess.run(
        [sys.executable, "-m", "surfaces", *args],
        env=tally_env(tmp_path),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
