"""The package installs and its command answers."""

from __future__ import annotations

import subprocess
import sys

import pytest

from roster import Member


def test_tally_version_runs() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "surfaces", "version"], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip()


def test_member_needs_port_placeholder() -> None:
    with pytest.raises(ValueError, match="port"):
        Member(name="m", command=["srv", "--model", "x"])
