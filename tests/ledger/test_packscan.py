"""Deep verify's pack scan in a child process: it equals the scan in the verifying process, and
a child that fails, dies or answers anything but a whole, consistent reply changes nothing in
the report (the parent scans the pack itself)."""

from __future__ import annotations

import asyncio
import struct
import sys
from pathlib import Path

import pytest

from daemon.ledger import Ledger, LedgerFailed, audit, packjob, packscan, store
from daemon.ledger.audit import VerifyReport
from daemon.ledger.packjob import PackJob, decode_reply, snapshot, start_scan
from daemon.ledger.packscan import PackScan, encode_reply, scan


def test_the_store_uses_the_scans_one_declaration_of_the_pack() -> None:
    assert store.PACK_HEADER is packscan.PACK_HEADER
    assert store.REDACTED == packscan.REDACTED
    assert store._SLOT is packscan.SLOT


@pytest.fixture
def in_child(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(packjob, "CHILD_MIN_BYTES", 0)
    monkeypatch.setattr(packjob, "_cores", lambda: 2)


async def damaged(state_dir: Path) -> tuple[Ledger, list[str]]:
    """A read-only ledger of 60 entries: one body changed, one redacted with a witness, one
    zeroed and flagged without one, one named twice; the table intact."""
    writer = await Ledger.open(state_dir, checkpoint_interval=None)
    names = []
    for i in range(60):
        body = {"same": True} if i % 10 == 3 else {"i": i, "text": f"body {i:04d}"}
        names.append((await writer.append(actor="t", kind="note", body=body)).body or "")
    await writer.redact(names[20], actor="admin", reason="pii")
    await writer.close()
    pack = state_dir / "ledger" / "bodies.pack"
    data = bytearray(pack.read_bytes())
    at = data.index(b'"text":"body 0007"')
    data[at + 9] ^= 1
    at = data.index(bytes.fromhex(names[40]))
    length = struct.unpack_from("<I", data, at + 32)[0]
    data[at + 32 : at + 40 + length] = struct.pack("<II", length, 1) + bytes(length)
    pack.write_bytes(bytes(data))
    return await Ledger.open(state_dir, readonly=True, checkpoint_interval=None), names


def verify_files(ledger: Ledger) -> VerifyReport:
    args = (ledger.dir / "entries.jsonl", ledger.tree, ledger.bodies, ledger.size, True, None)
    return audit.verify_files(*args)


async def test_the_child_scans_as_the_parent_does(state_dir: Path, in_child: None) -> None:
    ledger, names = await damaged(state_dir)
    job = start_scan(ledger.bodies)
    assert job.proc is not None, "the scan ran in a child"
    here = scan(snapshot(ledger.bodies))
    assert job.result() == here
    assert job.proc.returncode == 0
    assert names[7].encode() not in here.intact()
    assert names[8].encode() in here.intact()
    report = verify_files(ledger)
    assert report.tampered == [names[7], names[40]]
    assert report.redacted == [names[20]]
    await ledger.close()


REPLY = "import os, sys; os.write(int(sys.argv[3]),"  # a fake child's reply: ... bytes)


@pytest.mark.parametrize(
    "child",
    [
        "import sys; sys.exit(3)",
        "import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
        f"{REPLY} b'garbage')",
        f"{REPLY} b'tally-packscan/2\\n' + bytes(48) + b'\\nend\\n')",
        # A reply that would say every body is intact, cut short before its trailer.
        f"{REPLY} b'tally-packscan/2\\n' + bytes(48) + b'ab')",
        f"{REPLY} b'ok'); import sys; sys.exit(1)",
    ],
    ids=["exits-3", "killed", "garbage", "another-pack", "cut-short", "writes-then-fails"],
)
async def test_a_failing_child_changes_nothing(
    state_dir: Path,
    in_child: None,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    child: str,
) -> None:
    ledger, names = await damaged(state_dir)
    expected = verify_files(ledger)  # the real child
    monkeypatch.setattr(packjob, "CHILD_ARGS", [sys.executable, "-c", child])
    report = verify_files(ledger)
    assert not report.ok
    assert report == expected
    assert report.tampered == [names[7], names[40]]
    assert "pack scan child failed" in caplog.text
    await ledger.close()


async def test_the_child_cannot_write_the_daemons_pack(
    state_dir: Path,
    in_child: None,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    owner = await Ledger.open(state_dir, checkpoint_interval=None)  # its pack is read-write
    for i in range(20):
        await owner.append(actor="t", kind="note", body={"i": i})
    pack = (state_dir / "ledger" / "bodies.pack").read_bytes()
    child = "import os, sys; os.pwrite(int(sys.argv[1]), b'X' * 64, 0)"
    monkeypatch.setattr(packjob, "CHILD_ARGS", [sys.executable, "-c", child])
    assert (await owner.verify(deep=True)).ok
    assert "Bad file descriptor" in caplog.text  # the child's write was refused
    assert (state_dir / "ledger" / "bodies.pack").read_bytes() == pack
    await owner.close()


async def test_a_child_that_cannot_start_changes_nothing(
    state_dir: Path,
    in_child: None,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    ledger, _ = await damaged(state_dir)
    expected = verify_files(ledger)
    monkeypatch.setattr(packjob, "CHILD_ARGS", [str(state_dir / "no-such-program")])
    assert verify_files(ledger) == expected
    assert "pack scan child did not start" in caplog.text
    await ledger.close()


async def test_a_child_still_running_when_verify_stops_is_ended(
    state_dir: Path, in_child: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger, _ = await damaged(state_dir)
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    monkeypatch.setattr(packjob, "CHILD_ARGS", sleeper)
    job = start_scan(ledger.bodies)
    job.close()
    assert job.proc is not None
    assert job.proc.returncode is not None
    assert job.result() == scan(snapshot(ledger.bodies))  # and the parent scanned instead
    await ledger.close()


def reply_cases(good: bytes) -> list[bytes]:
    magic, trailer = packscan.MAGIC, packscan.TRAILER
    body = good[len(magic) : -len(trailer)]
    head, digests = body[: packscan.REPLY.size], body[packscan.REPLY.size :]
    size, end, indexed, unindexed, below, count = packscan.REPLY.unpack(head)

    def reply(*counts: int, names: bytes = digests) -> bytes:
        return magic + packscan.REPLY.pack(*counts) + names + trailer

    return [
        good[1:],
        good[:-1],
        reply(size + 1, end, indexed, unindexed, below, count),
        reply(size, end - 1, indexed, unindexed, below, count),
        reply(size, end, indexed, 2, below, count),
        reply(size, end, indexed, unindexed, 1 << 40, count),  # more slots than the table has
        reply(size, end, indexed, unindexed, below, count + 1),
        reply(size, end, indexed, unindexed, below, count, names=digests[:-1] + b"g"),
        reply(size, end, indexed, unindexed, below, count, names=digests[:-1] + b"A"),
        reply(size, end, indexed, unindexed, below, count - 1, names=digests[:-1]),
    ]


async def test_every_malformed_reply_is_refused(state_dir: Path) -> None:
    ledger, _ = await damaged(state_dir)
    snap = snapshot(ledger.bodies)
    found = scan(snap)
    good = encode_reply(snap, found)
    assert decode_reply(good, snap) == found
    for bad in reply_cases(good):
        with pytest.raises(ValueError):
            decode_reply(bad, snap)
    empty = PackScan(slots=snap.slots, end=snap.end)
    assert decode_reply(encode_reply(snap, empty), snap) == empty
    await ledger.close()


def test_a_finished_job_is_ready() -> None:
    found = PackScan(unindexed=True)
    job = PackJob.finished(found)
    assert job.ready()
    assert job.result() is found


def test_names_in_pack_order_follow_and_others_fall_to_the_set() -> None:
    a, b, c = (bytes([48 + i]) * 64 for i in range(3))
    found = PackScan(order=a + b + c)
    assert found.follows(a)
    assert not found.follows(c)  # b comes next
    assert found.follows(b + c)
    assert found.follows(b"")
    again = PackScan(order=a + b + c)
    assert not again.follows(b)
    again.resync(b, within=128)
    assert again.follows(c)
    again.resync(a[1:] + b[:1], within=192)  # found, but not at a digest's start: it stays
    assert again.at == 192
    assert again.intact() == {a, b, c}
    far = PackScan(order=a + b + c)
    far.resync(c, within=128)  # only the next `within` bytes are searched: c is past them
    assert far.at == 0
    far.resync(c, within=192)
    assert far.at == 192


@pytest.fixture(params=[False, True], ids=["here", "child"])
def either(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pack scanned in the verifying process, then in a child."""
    if request.param:
        monkeypatch.setattr(packjob, "CHILD_MIN_BYTES", 0)
        monkeypatch.setattr(packjob, "_cores", lambda: 2)


async def notes(state_dir: Path, count: int) -> None:
    writer = await Ledger.open(state_dir, checkpoint_interval=None)
    for i in range(count):
        await writer.append(actor="t", kind="note", body={"i": i})
    await writer.close()


async def test_a_table_with_no_empty_slot_ends_the_walk(state_dir: Path, either: None) -> None:
    """Every slot of bodies.idx taken by another key: each probe ends after one lap, so deep
    verify reports the table instead of looping for ever, and so does a writer's append."""
    await notes(state_dir, 5)
    table = state_dir / "ledger" / "bodies.idx"
    table.write_bytes(struct.pack("<QQ", 12345, 999_999) * (table.stat().st_size // 16))
    ledger = await Ledger.open(state_dir, readonly=True, checkpoint_interval=None)
    report = await asyncio.wait_for(ledger.verify(deep=True), 30)
    assert not report.ok
    assert report.derived or report.tampered
    await ledger.close()
    again = await Ledger.open(state_dir, checkpoint_interval=None)
    with pytest.raises(LedgerFailed):
        await asyncio.wait_for(again.append(actor="t", kind="note", body={"new": 1}), 30)
    await again.close()


def test_slots_below_the_mark_are_counted_exactly() -> None:
    def below(end: int, *slots: tuple[int, int], tail: bytes = b"") -> int:
        table = b"".join(packscan.SLOT.pack(*slot) for slot in slots) + tail
        return scan(packscan.Snapshot(-1, 0, end, table)).below

    assert below(100) == 0
    full = ((7, 5), (0, 0), (9, 60), (0, 0))
    assert below(60, *full) == 2
    assert below(59, *full) == 1  # a record written since the mark
    assert below(60, *full, tail=b"\x01" * 7) == 2  # a torn tail is not a slot


async def test_a_stray_slot_is_reported(state_dir: Path, either: None) -> None:
    """Every record found from its home slot, but one more slot points into the pack: the
    count of slots below the mark (made by the scan, in the child too) sends the table to the
    exact audit, which names the slot."""
    await notes(state_dir, 40)
    path = state_dir / "ledger" / "bodies.idx"
    data = bytearray(path.read_bytes())
    free = next(i for i in range(0, len(data), 16) if not any(data[i : i + 16]))
    data[free : free + 16] = struct.pack("<QQ", 12345, 2)  # a record's middle
    path.write_bytes(bytes(data))
    ledger = await Ledger.open(state_dir, readonly=True, checkpoint_interval=None)
    found = start_scan(ledger.bodies).result()
    assert (found.indexed, found.below, found.unindexed) == (40, 41, False)
    report = await ledger.verify(deep=True)
    assert not report.ok
    assert any(f"slot {free // 16} points at offset 1" in p for p in report.derived), report
    await ledger.close()
