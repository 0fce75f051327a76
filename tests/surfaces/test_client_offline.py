"""`tally client` with the daemon down edits the client file itself; `client list` (read-only)
says it read the file, never that it changed it, and leaves the file as it was."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

from surfaces.cli import main


def _tally(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


def test_client_list_offline_reads_and_says_so(tmp_path: Path) -> None:
    state, nowhere = tmp_path / "state", tmp_path / "no-daemon.sock"
    where = ["--state", str(state), "--socket", str(nowhere)]
    code, token, err = _tally("client", "add", "ide", "--scope", "submit", "--rpm", "5", *where)
    assert code == 0, err
    assert token.strip()
    assert "changed the client file directly" in err
    before = (state / "clients.json").read_bytes()
    code, listed, err = _tally("client", "list", *where)
    assert code == 0, err
    assert "ide" in listed and "rpm 5" in listed
    assert "read the client file" in err
    assert "changed" not in err
    assert (state / "clients.json").read_bytes() == before
