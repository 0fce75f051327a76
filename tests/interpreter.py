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
