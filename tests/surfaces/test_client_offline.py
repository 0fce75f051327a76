"""`tally client` with the daemon down edits the client file itself; `client list` (read-only)
says it read the file, never that it changed it, and leaves the file as it was."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest

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
    assert "ide" in listed
    assert "rpm 5" in listed
    assert "read the client file" in err
    assert "changed" not in err
    assert (state / "clients.json").read_bytes() == before


def test_an_unreachable_url_is_said_not_read_from_this_machines_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TALLY_URL names a daemon that may be on another machine: when it cannot be reached the
    CLI says why (not "start it with tally serve") and does not read this machine's state dir
    as if it were that daemon's record."""
    from daemon.slots.process import free_port

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    for name in ("TALLY_SOCKET", "TALLY_TLS_FINGERPRINT", "TALLY_CACERT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TALLY_URL", url)
    monkeypatch.setenv("TALLY_TOKEN", "tly_x")
    monkeypatch.setenv("TALLY_STATE_DIR", str(tmp_path / "state"))
    for args in (["runs"], ["run", "r0123456789abcde"], ["status"]):
        code, _, err = _tally(*args)
        assert code == 1
        assert f"cannot reach the tally daemon at {url}: " in err, err
        assert "tally serve" not in err, err
        assert "record" not in err, err


@pytest.mark.parametrize("broken", [b'{"version": 1, "clients": [', b"\xff\xfe", b"[1, 2]"])
def test_a_broken_client_file_is_named_and_never_written_over(
    tmp_path: Path, broken: bytes
) -> None:
    state, nowhere = tmp_path / "state", tmp_path / "no-daemon.sock"
    where = ["--state", str(state), "--socket", str(nowhere)]
    assert _tally("client", "add", "ide", "--scope", "submit", *where)[0] == 0
    path = state / "clients.json"
    path.write_bytes(broken)
    for argv in (["list"], ["add", "two", "--scope", "read"], ["revoke", "ide"]):
        code, out, err = _tally("client", *argv, *where)
        assert code == 1, (argv, out, err)
        assert f"client file {path}" in err, err
        assert "fix it by hand" in err, err
        assert "ValidationError" not in err, err
        assert path.read_bytes() == broken
