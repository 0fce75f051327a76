"""What a chat task in a workspace is shown of the files its instruction names."""

from __future__ import annotations

from pathlib import Path

from daemon.workspace.context import block


def test_a_named_binary_file_is_said_not_dumped(tmp_path: Path) -> None:
    # A new user named logo.png in a request: its bytes went into the prompt as U+FFFD noise.
    (tmp_path / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)))
    (tmp_path / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    shown = block(tmp_path, "put logo.png beside calc.py", 10_000)
    assert "Not shown, binary files: logo.png" in shown
    assert "IHDR" not in shown
    assert "calc.py\n```\ndef add(a, b):\n    return a - b\n\n```" in shown
    assert "logo.png" in shown.split("\n\n")[0]  # still in the listing
