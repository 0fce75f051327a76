"""Write failures the ledger survives, injected at the system calls (EIO on fsync, ENOSPC on a
short write). The real full disk is `test_enospc.py` (a small tmpfs)."""

from __future__ import annotations

import asyncio
import errno
import os
from pathlib import Path

import pytest

from daemon.ledger import Ledger, LedgerUnwritable, writer
from tests.polling import until


async def until_writable(ledger: Ledger) -> None:
    await until(lambda: ledger.health.writable, what=lambda: f"writable: {ledger.health}")


def sizes(state_dir: Path) -> tuple[int, int]:
    root = state_dir / "ledger"
    return (root / "entries.jsonl").stat().st_size, (root / "bodies.pack").stat().st_size


def break_syncs(monkeypatch: pytest.MonkeyPatch, code: int, words: str) -> None:
    """Every fsync and fdatasync fails (the journal's commit uses fdatasync)."""

    def broken(fd: int) -> None:
        raise OSError(code, words)

    monkeypatch.setattr(os, "fsync", broken)
    monkeypatch.setattr(os, "fdatasync", broken)


async def test_a_failed_fsync_rolls_the_batch_back_and_appends_resume(
    state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger = await Ledger.open(state_dir, checkpoint_interval=None)
    acked = [await ledger.append(actor="t", kind="note", body={"i": i}) for i in range(3)]
    before = sizes(state_dir)
    break_syncs(monkeypatch, errno.EIO, "Input/output error")
    with pytest.raises(LedgerUnwritable) as err:
        await ledger.append(actor="t", kind="note", body={"lost": True})
    assert err.value.status == 503
    assert err.value.retry_after > 0
    assert err.value.details["reason"] == "io_error"
    health = ledger.health
    assert (health.writable, health.reason) == (False, "io_error")
    # While it cannot write it fails fast, checkpoints included, and nothing grows.
    with pytest.raises(LedgerUnwritable):
        await ledger.append(actor="t", kind="note")
    with pytest.raises(LedgerUnwritable) as cp:
        await ledger.checkpoint()
    assert "no checkpoint was written" in cp.value.message
    assert ledger.size == 3
    await asyncio.sleep(0.6)  # a probe or two fail: the rollback's own fsync fails as well
    assert not ledger.health.writable
    monkeypatch.undo()
    await until_writable(ledger)
    # The failed batch is gone from the files (cut back on a fresh file description), never
    # fsynced "again" and kept.
    assert sizes(state_dir) == before
    after = await ledger.append(actor="t", kind="note", body={"i": 3})
    assert after.seq == 3
    assert ledger.health.write_failures >= 2
    await ledger.close()
    again = await Ledger.open(state_dir, readonly=True)
    assert again.size == 4
    for entry in [*acked, after]:
        assert (await again.get(entry.seq)).hash == entry.hash
    assert (await again.entries(0, 10, kind="note"))[-1].seq == 3
    report = await again.verify(deep=True)
    assert report.ok, report
    await again.close()


async def test_a_short_write_then_enospc_leaves_no_partial_line(
    state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger = await Ledger.open(state_dir, checkpoint_interval=None)
    await ledger.append(actor="t", kind="note", body={"i": 0})
    entries_fd = ledger._entries_fd
    real = os.write

    def full(fd: int, data: bytes) -> int:
        if fd == entries_fd:
            if len(data) > 8:  # the disk takes a few bytes, then is full
                return real(fd, bytes(data)[:8])
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data)

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(LedgerUnwritable) as err:
        await ledger.append(actor="t", kind="note", body={"i": 1})
    assert err.value.details["reason"] == "disk_full"
    assert ledger.health.reason == "disk_full"
    monkeypatch.undo()
    await until_writable(ledger)
    entry = await ledger.append(actor="t", kind="note", body={"i": 2})
    assert entry.seq == 1
    await ledger.close()
    lines = (state_dir / "ledger" / "entries.jsonl").read_bytes().split(b"\n")
    assert len(lines) == 3
    assert lines[-1] == b""
    again = await Ledger.open(state_dir, readonly=True)
    assert [(await again.body(e.body)).value for e in await again.entries(0, 10)] == [
        {"i": 0},
        {"i": 2},
    ]
    assert (await again.verify(deep=True)).ok
    await again.close()


async def test_appends_queued_behind_a_failed_batch_are_refused_not_written(
    state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger = await Ledger.open(state_dir, checkpoint_interval=None)
    await ledger.append(actor="t", kind="note")
    break_syncs(monkeypatch, errno.ENOSPC, "No space left on device")
    results = await asyncio.gather(
        *(ledger.append(actor="t", kind="note", body={"i": i}) for i in range(50)),
        return_exceptions=True,
    )
    assert all(isinstance(r, LedgerUnwritable) for r in results), results
    monkeypatch.undo()
    await until_writable(ledger)
    assert (await ledger.append(actor="t", kind="note")).seq == 1
    await ledger.close()


def full_disk(path: Path, data: bytes, mode: int = 0o600) -> None:
    raise OSError(errno.ENOSPC, "No space left on device")


async def test_a_durable_batch_is_acknowledged_when_only_the_derived_sync_fails(
    state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger = await Ledger.open(state_dir, checkpoint_interval=None)
    await ledger.append(actor="t", kind="note")
    monkeypatch.setattr(writer, "write_atomic", full_disk)  # meta.json cannot be rewritten
    ledger._synced = -writer.SYNC_EVERY  # the next batch syncs the derived files
    entry = await ledger.append(actor="t", kind="note", body={"kept": True})
    assert entry.seq == 1  # the journal's sync returned: acknowledged, then the outage begins
    assert not ledger.health.writable
    with pytest.raises(LedgerUnwritable):
        await ledger.append(actor="t", kind="note")
    monkeypatch.undo()
    await until_writable(ledger)
    await ledger.close()
    again = await Ledger.open(state_dir, readonly=True)
    assert again.size == 2
    assert (await again.body((await again.get(1)).body)).value == {"kept": True}
    await again.close()


async def test_a_checkpoint_on_a_full_disk_is_a_mapped_error(
    state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger = await Ledger.open(state_dir, checkpoint_interval=None)
    await ledger.append(actor="t", kind="note")
    monkeypatch.setattr(writer, "write_atomic", full_disk)
    with pytest.raises(LedgerUnwritable) as err:
        await ledger.checkpoint()
    assert (err.value.status, err.value.code) == (503, "ledger_unwritable")
    assert ledger.latest_checkpoint() is None
    monkeypatch.undo()
    await until_writable(ledger)
    assert (await ledger.checkpoint()).size == 1
    await ledger.close()
