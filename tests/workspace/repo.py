"""Real git repositories and workspaces for the workspace tests."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

BUGGY = "def add(a, b):\n    return a - b\n"
FIXED = "def add(a, b):\n    return a + b\n"
TESTS = "from calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"


def git(cwd: Path, *args: str) -> str:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(cwd),
        "GIT_CONFIG_NOSYSTEM": "1",
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@t",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@t",
    }
    done = subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, check=True)
    return done.stdout.decode()


def project(root: Path, *, repo: bool = True) -> Path:
    """A small Python project with a bug its own test finds (a git repository by default)."""
    ws = root / "project"
    ws.mkdir(parents=True)
    (ws / "calc.py").write_text(BUGGY)
    (ws / "test_calc.py").write_text(TESTS)
    (ws / ".env").write_text("SECRET=hunter2\n")
    (ws / "deploy.pem").write_text("-----BEGIN PRIVATE KEY-----\n")
    if repo:
        (ws / ".gitignore").write_text("__pycache__/\n")
        git(ws, "init", "-q")
        git(ws, "add", "calc.py", "test_calc.py", ".gitignore")
        git(ws, "commit", "-q", "-m", "start")
    return ws
