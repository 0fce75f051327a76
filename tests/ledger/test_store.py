"""Durability of file creation: a new file's directory entry is fsynced too."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from daemon.ledger import Ledger
from daemon.ledger.store import create_dir, open_append, write_atomic

Synced = list[tuple[str, int, int]]  # ("dir" | "file", st_dev, st_ino), in fsync order


@pytest.fixture
def synced(monkeypatch: pytest.MonkeyPatch) -> Synced:
    """Record what each os.fsync hit (by inode: fds are reused once closed)."""
    calls: Synced = []
    real = os.fsync

    def recording(fd: int) -> None:
        st = os.fstat(fd)
        calls.append(("dir" if stat.S_ISDIR(st.st_mode) else "file", st.st_dev, st.st_ino))
        real(fd)

    monkeypatch.setattr(os, "fsync", recording)
    return calls


def ident(path: Path) -> tuple[str, int, int]:
    st = path.stat()
    return ("dir" if stat.S_ISDIR(st.st_mode) else "file", st.st_dev, st.st_ino)


def test_open_append_fsyncs_a_new_file_then_its_directory(tmp_path: Path, synced: Synced) -> None:
    path = tmp_path / "entries.jsonl"
    fd = open_append(path)
    os.close(fd)
    assert synced == [ident(path), ident(tmp_path)]
    synced.clear()
    fd = open_append(path)  # it exists now: nothing to make durable
    os.close(fd)
    assert synced == []


def test_write_atomic_fsyncs_the_directory_after_the_rename(tmp_path: Path, synced: Synced) -> None:
    path = tmp_path / "meta.json"
    write_atomic(path, b"{}")
    assert synced[-1] == ident(tmp_path)
    assert synced[0][0] == "file"
    assert path.read_bytes() == b"{}"


def test_create_dir_fsyncs_the_parent(tmp_path: Path, synced: Synced) -> None:
    create_dir(tmp_path / "ledger")
    assert synced == [ident(tmp_path)]


async def test_a_new_ledger_fsyncs_its_directory_after_creating_entries(
    state_dir: Path, synced: Synced
) -> None:
    ledger = await Ledger.open(state_dir, checkpoint_interval=None)
    await ledger.close()
    entries, directory = ident(state_dir / "ledger" / "entries.jsonl"), ident(state_dir / "ledger")
    assert ident(state_dir) in synced  # the new ledger/ dir itself
    assert entries in synced
    assert directory in synced[synced.index(entries) + 1 :]
