"""What the CLI tells a user after a run on a workspace fails: a command that works."""

from __future__ import annotations

from pathlib import Path

import pytest

from surfaces.cli import main, runs


def test_a_failed_workspace_run_points_at_retry_on_the_workspace_as_it_is(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # engine.retry takes a workspace run (on a fresh snapshot, the done tasks' changes carried)
    run = {"id": "r1", "state": "failed", "error": "boom", "workspace": "/src/shop"}
    assert runs._ending(run, as_json=False) == 1
    err = capsys.readouterr().err
    assert "`tally retry r1` runs what is not done again, on /src/shop as it is then" in err
    assert "tally run r1" in err


def test_a_failed_plain_run_still_points_at_retry(capsys: pytest.CaptureFixture[str]) -> None:
    run = {"id": "r2", "state": "failed", "error": "boom", "workspace": None}
    assert runs._ending(run, as_json=False) == 1
    assert "`tally retry r2` runs what is not done again" in capsys.readouterr().err


def test_serve_refuses_a_workspace_root_that_is_not_a_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A typo in --workspace-root used to start the daemon and refuse every submit later.
    (tmp_path / "src").mkdir()
    argv = ["serve", "--state", str(tmp_path / "state"), "--socket", str(tmp_path / "s")]
    argv += ["--workspace-root", str(tmp_path / "src"), "--workspace-root", str(tmp_path / "sr")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"--workspace-root {tmp_path / 'sr'}: not a directory" in err
    assert not (tmp_path / "s").exists()  # refused before anything listened


def test_a_failed_workspace_run_with_done_changes_points_at_patch_and_apply(
    capsys: pytest.CaptureFixture[str],
) -> None:
    run: dict[str, object] = {"id": "r3", "state": "failed", "workspace": "/src/shop"}
    run["patch_files"] = ["calc.py"]
    assert runs._ending(run, as_json=False) == 1
    err = capsys.readouterr().err
    assert "its done tasks changed 1 file: `tally patch r3` shows the diff" in err
    assert "`tally apply r3` applies it" in err
