"""What open does when the record lost bytes: a bodies.pack cut under acknowledged entries is
refused, naming the seq (only an unacknowledged last batch is dropped), and missing entry lines
are named by the same seq at open and in `tally ledger verify`."""

from __future__ import annotations

import asyncio
import json
import os
import tracemalloc
from pathlib import Path

import pytest

from daemon.ledger import Ledger, LedgerCorrupt, bulk
from daemon.ledger.journal import HEADER, MAGIC, scan
from daemon.ledger.store import MARKS, marks_before
from surfaces.cli import main
from tests.ledger.files import hashes


def pack(state_dir: Path) -> Path:
    return state_dir / "ledger" / "bodies.pack"


def cut_before(state_dir: Path, body: bytes) -> int:
    """Truncate the pack inside the record holding `body`; returns the new size."""
    data = pack(state_dir).read_bytes()
    at = data.index(body) - 20  # inside the record's header
    with pack(state_dir).open("r+b") as f:
        f.truncate(at)
    return at


async def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = await asyncio.to_thread(main, list(argv))
    return code, capsys.readouterr().out


async def one_by_one(ledger: Ledger, start: int, stop: int) -> None:
    for i in range(start, stop):  # one batch (and one ts) each
        await ledger.append(actor="t", kind="note", body={"i": i})


async def test_a_pack_cut_under_acknowledged_entries_refuses_naming_the_seq(
    state_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ledger = await Ledger.open(state_dir, checkpoint_interval=None)
    for start in range(0, 400, 100):  # four derived syncs: four marks
        await one_by_one(ledger, start, start + 100)
        await ledger.checkpoint()
    await ledger.close()
    size = cut_before(state_dir, b'{"i":217}')
    entries = (state_dir / "ledger" / "entries.jsonl").read_bytes()
    # The bisection over the sync marks starts the scan at 200, not 0.
    assert marks_before(state_dir / "ledger" / MARKS, size, 400) == 200
    for readonly in (False, True):
        with pytest.raises(LedgerCorrupt) as err:
            await Ledger.open(state_dir, readonly=readonly)
        assert err.value.seq == 217
        assert "its body is gone: bodies.pack ends at byte" in err.value.reason
    # Nothing was "repaired" away: the evidence is as it was.
    assert pack(state_dir).stat().st_size == size
    assert (state_dir / "ledger" / "entries.jsonl").read_bytes() == entries
    code, out = await cli(capsys, "ledger", "verify", "--json", "--state", str(state_dir))
    assert code == 1
    assert json.loads(out)["first_bad_seq"] == 217


def journal(state_dir: Path) -> Path:
    return state_dir / "ledger" / "wal"


async def crash_after_two_cycles(state_dir: Path) -> None:
    """Entries 0..4 caught up (checkpoint), 5..7 one batch each, then 8 and 9 in one batch,
    then a crash: 5..9 are acknowledged, in the files' page cache and in the journal."""
    ledger = await Ledger.open(state_dir, checkpoint_interval=None)
    await one_by_one(ledger, 0, 5)
    await ledger.checkpoint()
    await one_by_one(ledger, 5, 8)
    await asyncio.gather(*(ledger.append(actor="t", kind="note", body={"i": i}) for i in (8, 9)))
    await ledger.abandon()


def power_loss(state_dir: Path) -> None:
    """The files' unsynced tails are gone: the pack's from inside body 7, entries' after 5."""
    cut_before(state_dir, b'{"i":7}')
    lines = (state_dir / "ledger" / "entries.jsonl").read_bytes().splitlines(keepends=True)
    (state_dir / "ledger" / "entries.jsonl").write_bytes(b"".join(lines[:6]))


async def test_bytes_the_files_lost_past_the_last_catch_up_come_back_from_the_journal(
    state_dir: Path,
) -> None:
    await crash_after_two_cycles(state_dir)
    power_loss(state_dir)
    again = await Ledger.open(state_dir)
    assert again.size == 10
    assert [(await again.body(e.body)).value for e in await again.entries(0, 10)] == [
        {"i": i} for i in range(10)
    ]
    assert (await again.verify(deep=True)).ok
    await again.close()


async def test_without_the_journal_a_lost_body_under_a_later_batch_is_refused(
    state_dir: Path,
) -> None:
    await crash_after_two_cycles(state_dir)
    journal(state_dir).unlink()
    cut_before(state_dir, b'{"i":7}')
    with pytest.raises(LedgerCorrupt) as err:
        await Ledger.open(state_dir)
    assert err.value.seq == 7
    assert "a later batch" in err.value.reason


async def test_a_torn_journal_record_is_an_unacknowledged_batch_dropped_whole(
    state_dir: Path,
) -> None:
    await crash_after_two_cycles(state_dir)
    # The last batch's record did not reach the disk whole: that batch was never acknowledged,
    # so its lines and body records go, even those the page cache had written to the files.
    last = scan(journal(state_dir).read_bytes())[-1]
    with journal(state_dir).open("r+b") as f:
        f.seek(last.end - 5)
        f.write(bytes(5))
    again = await Ledger.open(state_dir)
    assert again.size == 8
    assert (await again.verify(deep=True)).ok
    assert b'{"i":8}' not in pack(state_dir).read_bytes()
    await again.close()


async def test_without_the_journal_a_lost_body_in_the_last_batch_is_an_unacknowledged_tail(
    state_dir: Path,
) -> None:
    await crash_after_two_cycles(state_dir)
    journal(state_dir).unlink()
    cut_before(state_dir, b'{"i":8}')
    again = await Ledger.open(state_dir)
    assert again.size == 8
    assert (await again.verify(deep=True)).ok
    await again.close()


async def test_a_reader_after_a_power_loss_says_what_the_journal_holds_and_writes_nothing(
    state_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    await crash_after_two_cycles(state_dir)
    power_loss(state_dir)
    before = hashes(state_dir)
    # No owner is running. A reader does not restore the files (only the owner's open does):
    # it reads the prefix they hold and verify says what is missing, not "ok".
    code, out = await cli(capsys, "ledger", "verify", "--deep", "--state", str(state_dir))
    assert code == 1, out
    assert out.startswith("FAILED at seq 6: the record files end before seq 6; the journal ")
    assert "holds entries up to seq 9 that were never written back" in out
    assert f"start the daemon on {state_dir} to restore them" in out
    code, out = await cli(capsys, "ledger", "verify", "--json", "--state", str(state_dir))
    assert code == 1
    assert json.loads(out)["first_bad_seq"] == 6
    reader = await Ledger.open(state_dir, readonly=True)
    assert reader.size == 6
    assert reader.record_note is not None
    assert "never written back" in reader.record_note
    await reader.close()
    assert hashes(state_dir) == before  # not a byte changed, the lock file included
    owner = await Ledger.open(state_dir)  # the owner's open restores them
    assert owner.size == 10
    await owner.close()
    code, out = await cli(capsys, "ledger", "verify", "--deep", "--state", str(state_dir))
    assert code == 0, out
    assert out.startswith("ok: 10 entries")


async def test_a_reader_takes_no_lock(state_dir: Path) -> None:
    await crash_after_two_cycles(state_dir)
    power_loss(state_dir)
    reader = await Ledger.open(state_dir, readonly=True)
    owner = await Ledger.open(state_dir)  # a reader open meanwhile holds nothing
    assert (reader.size, owner.size) == (6, 10)
    assert (state_dir / "ledger" / "lock").read_text() == f"{os.getpid()}\n"
    await reader.close()
    await owner.close()


async def test_a_reader_leaves_an_unacknowledged_batch_to_its_owner(
    state_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    await crash_after_two_cycles(state_dir)
    last = scan(journal(state_dir).read_bytes())[-1]
    with journal(state_dir).open("r+b") as f:  # the last batch was never acknowledged
        f.seek(last.end - 5)
        f.write(bytes(5))
    before = hashes(state_dir)
    reader = await Ledger.open(state_dir, readonly=True)
    assert reader.size == 8  # what the journal vouches for, not the batch past it
    report = await reader.verify(deep=True)
    assert report.ok
    assert "an unacknowledged batch past seq 7" in report.warnings[0]
    await reader.close()
    code, out = await cli(capsys, "ledger", "verify", "--state", str(state_dir))
    assert code == 0, out
    assert "WARNING: the record files hold an unacknowledged batch past seq 7" in out
    assert hashes(state_dir) == before
    owner = await Ledger.open(state_dir)  # the owner cuts it
    assert owner.size == 8
    await owner.close()
    assert b'{"i":8}' not in pack(state_dir).read_bytes()


async def test_a_reader_leaves_the_files_to_a_running_owner(state_dir: Path) -> None:
    owner = await Ledger.open(state_dir, checkpoint_interval=None)
    await one_by_one(owner, 0, 3)
    entries = state_dir / "ledger" / "entries.jsonl"
    whole = entries.read_bytes()
    entries.write_bytes(whole[: whole.index(b"\n") + 1])  # as if a commit were in flight
    reader = await Ledger.open(state_dir, readonly=True)  # the owner holds the lock
    assert reader.size == 1
    await reader.close()
    assert entries.read_bytes() == whole[: whole.index(b"\n") + 1]
    await owner.abandon()


async def test_a_journal_header_claiming_gigabytes_ends_the_journal_unread(
    state_dir: Path,
) -> None:
    await crash_after_two_cycles(state_dir)
    last = scan(journal(state_dir).read_bytes())[-1]
    # It continues the last record, and says its payload is 8 GiB long.
    fields = (last.next_seq, last.entries_end, last.pack_end, 1, 0xFFFFFFFF, 0xFFFFFFFF)
    with journal(state_dir).open("r+b") as f:
        f.seek(last.end)
        f.write(HEADER.pack(MAGIC, 0, *fields))
    tracemalloc.start()
    try:
        for readonly in (True, False):
            again = await Ledger.open(state_dir, readonly=readonly)
            assert again.size == 10
            await again.close()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20  # the payload was never asked for (a read of it allocated 8 GiB)


N = 6220


@pytest.mark.parametrize(
    ("gone", "seq", "words"),
    [
        (range(5720, 5731), 5720, "entries 5720..5730 are missing (the next line holds seq 5731)"),
        (range(100, 101), 100, "entry 100 is missing (the next line holds seq 101)"),
        (range(6210, 6216), 6210, "entries 6210..6215 are missing"),
        (range(6217, N), 6217, "entries from seq 6217 on are missing"),
    ],
)
async def test_open_and_verify_name_the_same_seq_for_missing_lines(
    state_dir: Path, capsys: pytest.CaptureFixture[str], gone: range, seq: int, words: str
) -> None:
    bulk.build(state_dir, N)
    path = state_dir / "ledger" / "entries.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join(line for i, line in enumerate(lines) if i not in gone))
    for readonly in (False, True):
        with pytest.raises(LedgerCorrupt) as err:
            await Ledger.open(state_dir, readonly=readonly)
        assert err.value.seq == seq
        assert words in err.value.reason
    code, out = await cli(capsys, "ledger", "verify", "--json", "--state", str(state_dir))
    assert code == 1
    report = json.loads(out)
    assert report["first_bad_seq"] == seq
    assert words in report["reason"]


async def test_a_damaged_journal_record_under_later_ones_refuses_and_cuts_nothing(
    state_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A crash, then the journal's record of seq 6 damaged: the files still hold 6..9, which
    the owner's replay would cut as past the journal's end. They are acknowledged entries of
    several batches, no crash's shape: refused, named, nothing written."""
    await crash_after_two_cycles(state_dir)
    records = scan(journal(state_dir).read_bytes())
    damaged = next(r for r in records if r.seq == 6)
    with journal(state_dir).open("r+b") as f:
        f.seek(damaged.end - 3)
        f.write(b"\xff")
    before = hashes(state_dir)
    code, out = await cli(capsys, "ledger", "verify", "--state", str(state_dir))
    assert code == 1
    assert out.startswith(
        "FAILED at seq 6: entries.jsonl holds, past the journal's last entry "
        "(seq 5), lines of more than one batch"
    ), out
    assert hashes(state_dir) == before
    with pytest.raises(LedgerCorrupt) as err:
        await Ledger.open(state_dir)
    assert err.value.seq == 6
    after = hashes(state_dir)
    del after["ledger/lock"], before["ledger/lock"]  # the owner's pid (this process's, again)
    assert after == before
    assert len((state_dir / "ledger" / "entries.jsonl").read_bytes().splitlines()) == 10
