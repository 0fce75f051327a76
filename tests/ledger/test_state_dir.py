"""One state-dir default for the daemon and the offline `tally ledger` commands."""

from __future__ import annotations

from pathlib import Path

import pytest

from daemon import config
from daemon.config import Settings, default_state_dir
from daemon.ledger import bulk
from surfaces.cli import main

VARS = ("TALLY_STATE_DIR", "STATE_DIRECTORY", "XDG_STATE_HOME")


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    for name in VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return monkeypatch


def test_precedence(env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    assert default_state_dir() == tmp_path / "home" / ".local" / "state" / "tally"
    env.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    assert default_state_dir() == tmp_path / "xdg" / "tally"
    env.setenv("STATE_DIRECTORY", f"{tmp_path / 'systemd'}:{tmp_path / 'second'}")
    assert default_state_dir() == tmp_path / "systemd"
    env.setenv("TALLY_STATE_DIR", str(tmp_path / "tally"))
    assert default_state_dir() == tmp_path / "tally"
    env.setenv("TALLY_STATE_DIR", "")  # empty counts as unset
    assert default_state_dir() == tmp_path / "systemd"


def test_daemon_and_cli_share_the_function(
    env: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert config._state_dir is default_state_dir
    env.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    assert Settings.from_env().state_dir == tmp_path / "xdg" / "tally"
    # The CLI looks the function up in daemon.config when a ledger command runs.
    env.setattr(config, "default_state_dir", lambda: tmp_path / "asked")
    assert main(["ledger", "verify"]) == 2
    assert f"no ledger in {tmp_path / 'asked'}" in capsys.readouterr().err


def test_cli_finds_the_ledger_under_xdg_state_home(
    env: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tmp_path / "xdg" / "tally"
    state.mkdir(parents=True)
    bulk.build(state, 3)
    env.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    assert main(["ledger", "verify", "--json"]) == 0
    assert '"size": 3' in capsys.readouterr().out
    env.setenv("STATE_DIRECTORY", str(tmp_path / "empty"))  # outranks XDG_STATE_HOME
    assert main(["ledger", "verify"]) == 2
    assert "no ledger in" in capsys.readouterr().err
