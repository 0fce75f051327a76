"""What the CLI prints to a terminal shows control characters instead of obeying them: text
from outside (a model's answer, a request a client sent, a model server's log, a file name)
could otherwise set the title, write the clipboard (OSC 52), clear the screen or reorder what
is shown (bidi overrides). A pipe gets the bytes as they are."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from surfaces.cli import main

HOSTILE = "ok \x1b]52;c;ZXZpbA==\x07 then \x1b[2J, \x9b31m and \u202eevil\u202c done"


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("tty", [True, False])
def test_logs_to_a_terminal_show_control_characters(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tty: bool
) -> None:
    logs = tmp_path / "state" / "logs"
    logs.mkdir(parents=True)
    (logs / "daemon.log").write_text(HOSTILE + "\n")
    out = Tty() if tty else io.StringIO()
    monkeypatch.setattr("sys.stdout", out)
    assert main(["logs", "--state", str(tmp_path / "state"), "--daemon"]) == 0
    shown = out.getvalue()
    if not tty:
        assert HOSTILE in shown  # a pipe: as written
        return
    assert not any(c in shown for c in "\x1b\x07\x9b\u202e\u202c"), repr(shown)
    seen = "ok \\x1b]52;c;ZXZpbA==\\x07 then \\x1b[2J, \\x9b31m and \\u202eevil\\u202c done"
    assert seen in shown


def test_the_clis_own_erase_line_passes() -> None:
    from surfaces.cli import _Terminal

    out = Tty()
    _Terminal(out).write("\r\x1b[Kprogress\ttab\n")
    assert out.getvalue() == "\r\x1b[Kprogress\ttab\n"
