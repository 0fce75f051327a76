"""Deep verify reads entries.jsonl in blocks (`audit._Lines`): lines across any number of
blocks come out whole (a line longer than a block is kept in pieces and joined once)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from daemon.ledger import audit


@pytest.mark.parametrize("block", [1, 3, 4, 7, 64])
def test_lines_come_out_whole_whatever_the_block(
    tmp_path: Path, block: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(audit, "READ_BYTES", block)
    lines = [b"a", b"", b"bcd", b"e" * 50, b"fg", b"h" * 7]
    path = tmp_path / "entries.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n" + b"unended")
    fd = os.open(path, os.O_RDONLY)
    try:
        reader = audit._Lines(fd)
        assert reader.take(2) == lines[:2]
        assert reader.take(100) == lines[2:]  # fewer at the end; the unended tail is not a line
        assert reader.take(1) == []
    finally:
        os.close(fd)
