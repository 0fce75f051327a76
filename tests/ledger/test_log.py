from __future__ import annotations

import asyncio
import errno
import hashlib
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from daemon.errors import InvalidInput, NotFound
from daemon.ledger import (
    Entry,
    Ledger,
    LedgerCorrupt,
    LedgerLocked,
    LedgerUnwritable,
    bulk,
    verify_note,
)
from daemon.ledger.log import TAIL_CHECK
from daemon.ledger.merkle import verify_consistency, verify_inclusion


async def fill(ledger: Ledger, n: int, bodies: bool = True) -> list[Entry]:
    return list(
        await asyncio.gather(
            *(
                ledger.append(actor="t", kind="note", body={"i": i} if bodies else None)
                for i in range(n)
            )
        )
    )


def entries_path(state_dir: Path) -> Path:
    return state_dir / "ledger" / "entries.jsonl"


async def test_append_get_and_reopen(state_dir: Path) -> None:
    ledger = await Ledger.open(state_dir)
    first = await ledger.append(actor="a", kind="note", body={"k": 1}, run="r1")
    second = await ledger.append(actor="b", kind="reply", body=None, run="r1", parent=first.seq)
    assert (first.seq, second.seq, second.prev) == (0, 1, first.hash)
    assert await ledger.get(1) == second
    assert (await ledger.body(first.body)).value == {"k": 1}
    assert [e.seq for e in await ledger.causal_chain(1)] == [0, 1]
    await ledger.close()
    lines = entries_path(state_dir).read_bytes().split(b"\n")
    assert lines[0] == first.line()
    assert lines[1] == second.line()
    assert lines[2] == b""
    again = await Ledger.open(state_dir)
    assert again.size == 2
    assert await again.get(0) == first
    third = await again.append(actor="c", kind="note")
    assert third.prev == second.hash
    await again.close()


async def test_appends_are_group_committed(state_dir: Path) -> None:
    async with await Ledger.open(state_dir) as ledger:
        entries = await fill(ledger, 300)
        assert [e.seq for e in entries] == list(range(300))
        stats = ledger.stats
        assert stats.appends == 300
        assert stats.batches < 300
        assert stats.fsync_count == stats.batches
        assert stats.fsync_buckets[-1][1] == stats.batches


async def test_on_commit_runs_as_entries_commit_even_for_a_caller_that_stopped_waiting(
    state_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    ledger = await Ledger.open(state_dir, checkpoint_interval=None)
    seen: list[int] = []

    def hook(entry: Entry) -> None:
        seen.append(entry.seq)
        if entry.seq == 1:
            raise RuntimeError("a buggy hook")

    calls = [
        asyncio.create_task(ledger.append(actor="t", kind="note", body={"i": i}, on_commit=hook))
        for i in range(4)
    ]
    await asyncio.sleep(0)  # queued
    calls[2].cancel()  # its caller stops waiting: the entry commits and its hook runs all the same
    done = await asyncio.gather(*calls, return_exceptions=True)
    assert isinstance(done[2], asyncio.CancelledError)
    assert [e.seq for e in done if isinstance(e, Entry)] == [
        0,
        1,
        3,
    ]  # a raising hook breaks nothing
    assert seen == [0, 1, 2, 3]
    assert "on_commit hook failed for seq 1" in caplog.text

    def broken(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fdatasync", broken)
    with pytest.raises(LedgerUnwritable):  # rolled back: nothing committed, no hook
        await ledger.append(actor="t", kind="note", on_commit=hook)
    assert seen == [0, 1, 2, 3]
    monkeypatch.undo()
    await ledger.close()


async def test_append_soon_refuses_at_once_and_its_cancelled_future_still_commits(
    state_dir: Path,
) -> None:
    async with await Ledger.open(state_dir, checkpoint_interval=None) as ledger:
        with pytest.raises(InvalidInput):  # refused by the call itself, before any await
            ledger.append_soon(actor="a", kind="k", body={"x": 1.5})
        first = ledger.append_soon(actor="a", kind="k", body={"i": 0})
        second = ledger.append_soon(actor="a", kind="k", body={"i": 1})
        second.cancel()  # stops only the wait
        assert (await first).seq == 0
        third = await ledger.append(actor="a", kind="k")
        assert third.seq == 2
        assert (await ledger.get(1)).body == hashlib.sha256(b'{"i":1}').hexdigest()


async def test_rejects_bad_input(state_dir: Path) -> None:
    async with await Ledger.open(state_dir) as ledger:
        with pytest.raises(InvalidInput):
            await ledger.append(actor="a", kind="k", body={"x": 1.5})
        with pytest.raises(InvalidInput):
            await ledger.append(actor="a", kind="k", body=2**60)
        with pytest.raises(InvalidInput):
            await ledger.append(actor="a", kind="k", parent=3)
        with pytest.raises(NotFound):
            await ledger.get(0)


async def test_filters(state_dir: Path) -> None:
    async with await Ledger.open(state_dir) as ledger:
        for i in range(10):
            await ledger.append(actor=f"a{i % 2}", kind="x" if i % 3 else "y", run=f"r{i % 2}")
        await ledger.append(actor="z", kind="x")
        got = await ledger.entries(kind="y", run="r0")
        assert [e.seq for e in got] == [0, 6]
        assert [e.seq for e in await ledger.entries(start=5, limit=2, actor="a1")] == [5, 7]


async def test_proofs_from_the_ledger(state_dir: Path) -> None:
    async with await Ledger.open(state_dir) as ledger:
        entries = await fill(ledger, 77)
        proof = await ledger.inclusion_proof(13, size=50)
        ok = verify_inclusion(
            13,
            50,
            bytes.fromhex(entries[13].hash),
            [bytes.fromhex(p) for p in proof.path],
            bytes.fromhex(proof.root),
        )
        assert ok
        cons = await ledger.consistency_proof(21)
        assert cons.new_size == 77
        assert verify_consistency(
            21,
            77,
            bytes.fromhex(cons.old_root),
            bytes.fromhex(cons.new_root),
            [bytes.fromhex(p) for p in cons.path],
        )


async def test_checkpoint_is_signed_and_verifiable(state_dir: Path) -> None:
    ledger = await Ledger.open(state_dir)
    await fill(ledger, 5)
    checkpoint = await ledger.checkpoint()
    assert checkpoint.size == 5
    assert checkpoint.root == ledger.root()
    key = state_dir / "ledger" / "checkpoint.key"
    assert key.stat().st_mode & 0o777 == 0o600
    vkey = (state_dir / "ledger" / "checkpoint.vkey").read_text()
    assert verify_note(checkpoint.note, vkey).size == 5
    lines = checkpoint.note.split("\n")
    assert lines[1] == "5"
    assert lines[3].startswith("time ")
    assert lines[5].startswith("— ")
    await ledger.append(actor="a", kind="k")
    await ledger.close()  # checkpoints on close
    again = await Ledger.open(state_dir, readonly=True)
    latest = again.latest_checkpoint()
    assert latest is not None
    assert latest.size == 6
    tampered = checkpoint.note.replace("\n5\n", "\n4\n")
    with pytest.raises(ValueError):
        verify_note(tampered, vkey)
    await again.close()


async def test_periodic_checkpoint(state_dir: Path) -> None:
    ledger = await Ledger.open(state_dir, checkpoint_interval=0.05)
    await fill(ledger, 3)
    for _ in range(100):
        await asyncio.sleep(0.02)
        latest = ledger.latest_checkpoint()
        if latest is not None and latest.size == 3:
            break
    assert ledger.latest_checkpoint() is not None
    await ledger.close()


async def test_two_openers(state_dir: Path) -> None:
    ledger = await Ledger.open(state_dir)
    with pytest.raises(LedgerLocked) as err:
        await Ledger.open(state_dir)
    assert str(os.getpid()) in str(err.value)
    reader = await Ledger.open(state_dir, readonly=True)  # offline readers need no lock
    assert reader.size == 0
    await reader.close()
    await ledger.close()
    await (await Ledger.open(state_dir)).close()


async def test_readonly_sees_a_live_writer(state_dir: Path) -> None:
    ledger = await Ledger.open(state_dir)
    await fill(ledger, 40)
    reader = await Ledger.open(state_dir, readonly=True)
    assert reader.size == 40
    assert (await reader.verify(deep=True)).ok
    assert reader.root() == ledger.root()
    await reader.close()
    await ledger.close()


async def test_torn_tail_is_truncated(state_dir: Path) -> None:
    ledger = await Ledger.open(state_dir)
    await fill(ledger, 10)
    await ledger.close()
    path = entries_path(state_dir)
    good = path.read_bytes()
    with path.open("ab") as f:
        f.write(b'{"actor":"t","body":null,"ki')
    again = await Ledger.open(state_dir)
    assert again.size == 10
    assert path.read_bytes() == good
    assert (await again.verify()).ok
    await again.append(actor="t", kind="after")
    await again.close()
    assert (await (await Ledger.open(state_dir, readonly=True)).verify()).ok


async def test_interior_flip_refuses_open_and_verify_names_seq(state_dir: Path) -> None:
    ledger = await Ledger.open(state_dir)
    entries = await fill(ledger, 20)
    await ledger.close()
    path = entries_path(state_dir)
    data = bytearray(path.read_bytes())
    at = data.index(entries[7].line()) + data[data.index(entries[7].line()) :].index(b'"kind"')
    data[at + 9] ^= 0x01  # inside "note"
    path.write_bytes(bytes(data))
    with pytest.raises(LedgerCorrupt) as err:
        await Ledger.open(state_dir)
    assert err.value.seq == 7
    # A reader that skips the tail check (as on a huge ledger) still gets the seq from verify.
    reader = await Ledger.open(state_dir, readonly=True, tail_check=0)
    report = await reader.verify()
    assert not report.ok
    assert report.first_bad_seq == 7
    await reader.close()


async def test_a_flip_older_than_the_tail_check_opens_and_verify_names_seq(
    state_dir: Path,
) -> None:
    # Open re-hashes only the last TAIL_CHECK entries (it must not re-read the history), so a
    # flip further back does not stop the ledger from opening; verify() names the exact seq.
    n, bad = TAIL_CHECK + 500, 123
    bulk.build(state_dir, n)
    path = entries_path(state_dir)
    lines = path.read_bytes().split(b"\n")
    lines[bad] = lines[bad].replace(b'"kind":"note"', b'"kind":"nope"')
    path.write_bytes(b"\n".join(lines))
    ledger = await Ledger.open(state_dir)
    assert ledger.size == n
    report = await ledger.verify()
    assert not report.ok
    assert report.first_bad_seq == bad
    assert report.reason == "entry bytes do not match the recorded leaf hash"
    await ledger.close()
    # The same flip inside the checked tail refuses the open, naming the seq.
    lines[bad] = lines[bad].replace(b'"kind":"nope"', b'"kind":"note"')
    tail_bad = n - 10
    lines[tail_bad] = lines[tail_bad].replace(b'"kind":"note"', b'"kind":"nope"')
    path.write_bytes(b"\n".join(lines))
    with pytest.raises(LedgerCorrupt) as err:
        await Ledger.open(state_dir)
    assert err.value.seq == tail_bad


async def test_missing_index_is_rebuilt(state_dir: Path) -> None:
    ledger = await Ledger.open(state_dir)
    await fill(ledger, 100)
    root = ledger.root()
    await ledger.close()
    (state_dir / "ledger" / "index.bin").unlink()
    for level in (state_dir / "ledger" / "tree").iterdir():
        level.unlink()
    (state_dir / "ledger" / "bodies.idx").unlink()
    again = await Ledger.open(state_dir)
    assert again.size == 100
    assert again.root() == root
    assert (await again.body((await again.get(42)).body)).value == {"i": 42}
    assert (await again.verify(deep=True)).ok
    await again.close()


async def test_deep_verify_tampered_vs_redacted(state_dir: Path) -> None:
    ledger = await Ledger.open(state_dir)
    entries = await fill(ledger, 6)
    secret, changed = entries[2].body or "", entries[4].body or ""
    await ledger.redact(secret, actor="admin", reason="pii")
    assert (await ledger.body(secret)).value is None
    assert (await ledger.body(secret)).state == "redacted"
    await ledger.close()
    pack = state_dir / "ledger" / "bodies.pack"
    data = pack.read_bytes()
    assert b'{"i":2}' not in data
    pack.write_bytes(data.replace(b'{"i":4}', b'{"i":5}'))
    again = await Ledger.open(state_dir)
    shallow = await again.verify()
    assert shallow.ok  # chain and tree still hold
    report = await again.verify(deep=True)
    assert not report.ok
    assert report.redacted == [secret]
    assert report.tampered == [changed]
    assert report.first_bad_seq == 4
    await again.close()


async def test_entries_with_missing_bodies_at_the_tail_are_dropped(state_dir: Path) -> None:
    ledger = await Ledger.open(state_dir)
    await fill(ledger, 4)
    await ledger.close()
    # Simulate a crash after the entries' write but before the pack reached the disk.
    pack = state_dir / "ledger" / "bodies.pack"
    last = pack.read_bytes().rindex(b'{"i":3}')
    with pack.open("r+b") as f:
        f.truncate(last - 40)
    (state_dir / "ledger" / "checkpoint").unlink()
    (state_dir / "ledger" / "meta.json").unlink()
    again = await Ledger.open(state_dir)
    assert again.size == 3
    assert (await again.verify(deep=True)).ok
    await again.close()


async def test_a_missing_level_file_triggers_a_rebuild(state_dir: Path) -> None:
    ledger = await Ledger.open(state_dir)
    await fill(ledger, 37)
    root = ledger.root()
    await ledger.close()
    (state_dir / "ledger" / "tree" / "level-03.bin").unlink()
    again = await Ledger.open(state_dir)
    assert again.size == 37
    assert again.root() == root
    assert (await again.verify()).ok
    await again.close()


async def redact_then_crash(state_dir: Path, sync_in_between: bool) -> str:
    """Witness a redaction, then "crash" before the body is zeroed; returns the body hash."""
    ledger = await Ledger.open(state_dir, checkpoint_interval=None)
    entries = await fill(ledger, 5)
    await ledger.checkpoint()  # the entries so far are indexed and trusted
    secret = entries[2].body or ""

    def crash_before_zeroing(seq: int, digest: bytes) -> None:
        return None

    ledger._apply_redaction = crash_before_zeroing  # type: ignore[method-assign]
    witness = await ledger.redact(secret, actor="admin", reason="pii")
    assert witness.kind == "redaction"
    assert (await ledger.body(secret)).value == {"i": 2}  # the crash window: witnessed, still there
    if sync_in_between:
        await ledger.checkpoint()  # the witness is now inside the trusted (indexed) range
    await ledger.abandon()
    return secret


@pytest.mark.parametrize("sync_in_between", [False, True])
async def test_a_witnessed_redaction_survives_a_crash_before_the_zeroing(
    state_dir: Path, sync_in_between: bool
) -> None:
    secret = await redact_then_crash(state_dir, sync_in_between)
    again = await Ledger.open(state_dir, checkpoint_interval=None)
    assert again.size == 6
    assert (await again.body(secret)).value is None
    assert (await again.body(secret)).state == "redacted"
    report = await again.verify(deep=True)
    assert (report.redacted, report.tampered) == ([secret], [])
    await again.close()
    assert b'{"i":2}' not in (state_dir / "ledger" / "bodies.pack").read_bytes()
    # Once applied, the redaction is not pending any more: a clean reopen has nothing to do.
    third = await Ledger.open(state_dir, checkpoint_interval=None)
    assert (await third.body(secret)).state == "redacted"
    await third.close()


async def test_a_failed_zeroing_is_reapplied_on_open(state_dir: Path) -> None:
    ledger = await Ledger.open(state_dir, checkpoint_interval=None)
    entries = await fill(ledger, 3)
    secret = entries[1].body or ""

    def broken(digest: bytes, force: bool = False) -> bool:
        raise OSError(errno.EIO, "I/O error")

    ledger.bodies.redact = broken  # type: ignore[method-assign]
    with pytest.raises(LedgerUnwritable) as err:
        await ledger.redact(secret, actor="admin", reason="pii")
    assert "the redaction is witnessed (seq 3)" in err.value.message
    await ledger.close()
    again = await Ledger.open(state_dir, checkpoint_interval=None)
    assert again.size == 4
    assert (await again.body(secret)).state == "redacted"
    await again.close()


async def test_a_redaction_kind_without_a_witness_body_changes_nothing(state_dir: Path) -> None:
    ledger = await Ledger.open(state_dir, checkpoint_interval=None)
    kept = await ledger.append(actor="t", kind="note", body={"i": 1})
    await ledger.append(actor="t", kind="redaction", body={"note": kept.body})
    await ledger.abandon()
    again = await Ledger.open(state_dir, checkpoint_interval=None)
    assert (await again.body(kept.body)).value == {"i": 1}
    await again.close()


async def test_a_group_commit_is_one_fdatasync_of_the_journal_and_acks_after_it(
    state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch costs the journal's fdatasync and no other sync; the ack waits for it."""
    ledger = await Ledger.open(state_dir, checkpoint_interval=None)
    await ledger.append(actor="a", kind="k")
    journal = os.fstat(ledger._journal.fd).st_ino
    entered, gate = threading.Event(), threading.Event()
    synced: list[tuple[str, int]] = []
    real_fsync, real_fdatasync = os.fsync, os.fdatasync

    def fsync(fd: int) -> None:
        synced.append(("fsync", os.fstat(fd).st_ino))
        real_fsync(fd)

    def fdatasync(fd: int) -> None:
        synced.append(("fdatasync", os.fstat(fd).st_ino))
        entered.set()
        gate.wait(5)
        real_fdatasync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "fdatasync", fdatasync)
    tasks = [
        asyncio.create_task(ledger.append(actor="a", kind="k", body={"x": i})) for i in range(8)
    ]
    assert await asyncio.to_thread(entered.wait, 5)
    await asyncio.sleep(0.05)
    assert not any(task.done() for task in tasks)
    assert ledger.size == 1
    gate.set()
    entries = await asyncio.gather(*tasks)
    monkeypatch.undo()
    assert [e.seq for e in entries] == list(range(1, 9))
    assert synced == [("fdatasync", journal)]  # one batch, one sync, nothing else synced
    assert [(await ledger.body(e.body)).value for e in entries] == [{"x": i} for i in range(8)]
    await ledger.close()


async def test_deep_verify_says_changed_or_missing_without_a_witness(state_dir: Path) -> None:
    ledger = await Ledger.open(state_dir, checkpoint_interval=None)
    entries = await fill(ledger, 6)
    changed, zeroed, gone = (entries[i].body or "" for i in (1, 3, 4))
    ledger.bodies.redact(bytes.fromhex(zeroed))  # zeroed in place, no `redaction` entry
    await ledger.close()
    pack = state_dir / "ledger" / "bodies.pack"
    data = pack.read_bytes()
    # Overwrite the digest in the record header of body 4: its record is gone for the store.
    at = data.index(bytes.fromhex(gone))
    data = data[:at] + bytes(32) + data[at + 32 :]
    pack.write_bytes(data.replace(b'{"i":1}', b'{"i":7}'))
    again = await Ledger.open(state_dir, readonly=True)
    assert (await again.body(gone)).value is None
    report = await again.verify(deep=True)
    assert not report.ok
    assert report.first_bad_seq == 1
    assert report.redacted == []
    assert sorted(report.tampered) == sorted([changed, zeroed, gone])
    assert report.tampered_why == {
        changed: "changed",
        zeroed: "missing (no redaction witnessed)",
        gone: "missing (no redaction witnessed)",
    }
    await again.close()


async def test_one_thread_writes_and_syncs_and_one_callback_settles_a_batch(
    state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer thread does the write and the sync itself (no sync threads), and a batch's
    futures are resolved by one `call_soon_threadsafe`, not one per entry."""
    ledger = await Ledger.open(state_dir, checkpoint_interval=None)
    loop = asyncio.get_running_loop()
    callbacks: list[str] = []
    real_call = loop.call_soon_threadsafe

    def counted(callback: Any, *args: Any, **kwargs: Any) -> asyncio.Handle:
        callbacks.append(getattr(callback, "__name__", repr(callback)))
        return real_call(callback, *args, **kwargs)

    syncing: list[str] = []
    real_fdatasync = os.fdatasync

    def fdatasync(fd: int) -> None:
        syncing.append(threading.current_thread().name)
        real_fdatasync(fd)

    monkeypatch.setattr(loop, "call_soon_threadsafe", counted)
    monkeypatch.setattr(os, "fdatasync", fdatasync)
    before = ledger.stats.batches
    entries = await asyncio.gather(
        *(ledger.append(actor="a", kind="k", body={"i": i}) for i in range(256))
    )
    batches = ledger.stats.batches - before
    monkeypatch.undo()
    assert sorted(e.seq for e in entries) == list(range(256))
    assert batches < 256  # grouped
    assert callbacks == ["_settle"] * batches
    assert syncing == ["ledger-writer"] * batches
    # no sync thread beside the writer ("asyncio_N" are other tests' loops' executors)
    names = [t.name for t in threading.enumerate() if not t.name.startswith("asyncio_")]
    assert not [name for name in names if "sync" in name]
    await ledger.close()
