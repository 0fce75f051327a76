"""Shared fixtures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def pytest_configure(config: pytest.Config) -> None:
    """The suite never reads a user's TALLY_* settings: `make test` passes while a daemon runs
    with TALLY_SOCKET, TALLY_STATE_DIR, TALLY_URL... exported. Tests that need one set it."""
    for name in [n for n in os.environ if n.startswith("TALLY_")]:
        del os.environ[name]


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    path = tmp_path / "state"
    path.mkdir(mode=0o700)
    return path
