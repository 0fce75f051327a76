"""Deep verify checks chunks in bulk and walks entry by entry only where the bulk check is
unsure: every fault must still be reported exactly as the entry-by-entry walk reports it.

Each test damages the files of a read-only ledger in place, then compares `verify_files` with
the reference: the bulk check switched off, every body read through the store (as before the
pack scan) and the body table audited record by record. Small chunk sizes put faults in the
middle, at the start and at the end of chunks, and pins inside and at the edges of chunks.
"""

from __future__ import annotations

import json
import struct
from hashlib import sha256
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from daemon.ledger import Ledger, audit, lineform, packjob
from daemon.ledger.audit import DERIVED, VerifyReport
from daemon.ledger.canonical import MAX_SAFE_INT
from daemon.ledger.entry import Entry, encode_line
from daemon.ledger.packjob import PackJob
from daemon.ledger.packscan import PackScan

N = 150


@pytest.fixture(
    params=[(8, False), (64, False), (audit.CHUNK_ENTRIES, False), (8, True), (64, True)],
    ids=["8", "64", "whole", "8-child", "64-child"],
)
def chunk(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    """The chunk size; `-child` runs the pack scan in a child process and the canonical
    pattern on a thread of its own, as big ledgers do (the reference walk never does)."""
    size, child = request.param
    monkeypatch.setattr(audit, "CHUNK_ENTRIES", size)
    if child:
        monkeypatch.setattr(packjob, "CHILD_MIN_BYTES", 0)
        monkeypatch.setattr(packjob, "_cores", lambda: 2)
        monkeypatch.setattr(lineform, "THREAD_MIN_LINES", 1)
    return int(size)


def _reference_walk(*_: object) -> bool:
    return False


def _nothing_scanned(bodies: object) -> PackJob:
    return PackJob.finished(PackScan(unindexed=True))


def verify(
    ledger: Ledger,
    monkeypatch: pytest.MonkeyPatch,
    deep: bool = True,
    pinned: tuple[int, bytes] | None = None,
) -> VerifyReport:
    """The report of `verify_files`, after checking it equals the reference walk's."""
    args = (ledger.dir / "entries.jsonl", ledger.tree, ledger.bodies, ledger.size, deep, pinned)
    report = audit.verify_files(*args)
    with monkeypatch.context() as m:
        m.setattr(audit._Walk, "bulk", _reference_walk)
        m.setattr(packjob, "start_scan", _nothing_scanned)  # audit imports it at each use
        reference = audit.verify_files(*args)
    assert report == reference
    return report


def body_of(i: int) -> object:
    if i % 7 == 3:
        return None
    if i % 11 == 5:
        return {"same": True}  # stored once, named by several entries
    return {"i": i, "text": f"body {i:04d}", "list": [i, None, "ü\n"]}


ACTORS = ["t", "engine", 'quote " and \\ backslash', "ctrl \x01\x1f\t\x7f", "ünïcødé ✓ 𝄞"]


async def made(state_dir: Path) -> tuple[Ledger, list[Entry]]:
    """N entries with varied fields and bodies, one witnessed redaction; reopened read-only."""
    writer = await Ledger.open(state_dir, checkpoint_interval=None)
    entries = []
    for i in range(N - 1):
        entries.append(
            await writer.append(
                actor=ACTORS[i % len(ACTORS)],
                kind="note" if i % 5 else "task.done",
                body=body_of(i),
                run=None if i % 3 else ("" if i % 9 == 0 else f"run-{i % 4}"),
                parent=None if i % 4 or i == 0 else i - 1,
            )
        )
    entries.append(await writer.redact(entries[12].body or "", actor="admin", reason="pii"))
    await writer.close()
    return await Ledger.open(state_dir, readonly=True, checkpoint_interval=None), entries


def entries_file(ledger: Ledger) -> Path:
    return ledger.dir / "entries.jsonl"


def patch(path: Path, offset: int, data: bytes) -> None:
    """Overwrite bytes in place (the open ledger's descriptors see it)."""
    with path.open("r+b") as f:
        f.seek(offset)
        f.write(data)


def line_at(ledger: Ledger, seq: int) -> tuple[int, bytes]:
    data = entries_file(ledger).read_bytes()
    start = 0
    for _ in range(seq):
        start = data.index(b"\n", start) + 1
    return start, data[start : data.index(b"\n", start)]


def rewrite_line(ledger: Ledger, seq: int, new: bytes) -> None:
    """Replace entry `seq`'s line by one of the same length, and its leaf hash in the index
    (so the fault is the line itself, not a leaf mismatch)."""
    start, old = line_at(ledger, seq)
    assert len(new) == len(old)
    patch(entries_file(ledger), start, new)
    patch(ledger.dir / "index.bin", seq * 40, sha256(b"\x00" + new).digest())


async def test_an_intact_ledger_verifies_with_redacted_bodies_listed(
    state_dir: Path, chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger, entries = await made(state_dir)
    walked: list[int] = []
    one_by_one = audit._Walk.one_by_one

    def spy(walk: audit._Walk, seq: int, *args: object) -> None:
        walked.append(seq)
        one_by_one(walk, seq, *args)  # type: ignore[arg-type]

    args = (entries_file(ledger), ledger.tree, ledger.bodies, ledger.size, True, None)
    with monkeypatch.context() as m:
        m.setattr(audit._Walk, "one_by_one", spy)
        assert audit.verify_files(*args).ok
    assert walked == []  # an intact ledger is checked in bulk only
    report = verify(ledger, monkeypatch)
    assert report.ok, report
    assert report.redacted == [entries[12].body]
    assert verify(ledger, monkeypatch, deep=False).ok
    await ledger.close()


@pytest.mark.parametrize("seq", [0, 7, 8, 63, 64, 100, N - 1])
async def test_a_changed_entry_line(
    state_dir: Path, chunk: int, seq: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger, _ = await made(state_dir)
    start, line = line_at(ledger, seq)
    at = line.index(b'"ts":') + 6
    patch(entries_file(ledger), start + at, b"9" if line[at : at + 1] != b"9" else b"8")
    report = verify(ledger, monkeypatch)
    assert (report.first_bad_seq, report.reason) == (
        seq,
        "entry bytes do not match the recorded leaf hash",
    )
    await ledger.close()


@pytest.mark.parametrize("seq", [1, 8, 64, 65, N - 1])
async def test_a_broken_prev_chain(
    state_dir: Path, chunk: int, seq: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger, _ = await made(state_dir)
    _, line = line_at(ledger, seq)
    at = line.index(b'"prev":"') + 8
    wrong = line[:at] + (b"0" if line[at : at + 1] != b"0" else b"1") + line[at + 1 :]
    rewrite_line(ledger, seq, wrong)
    report = verify(ledger, monkeypatch)
    assert (report.first_bad_seq, report.reason) == (
        seq,
        "prev does not link to the previous entry",
    )
    await ledger.close()


@pytest.mark.parametrize("seq", [0, 9, 64, N - 1])
async def test_a_wrong_leaf_hash(
    state_dir: Path, chunk: int, seq: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger, _ = await made(state_dir)
    index = ledger.dir / "index.bin"
    byte = index.read_bytes()[seq * 40 + 5]
    patch(index, seq * 40 + 5, bytes([byte ^ 1]))
    latest = ledger.latest_checkpoint()
    assert latest is not None
    assert latest.size == N
    pinned = (N, bytes.fromhex(latest.root))
    if seq == N - 1:  # no next entry: with no checkpoint, only the index says what it was
        report = verify(ledger, monkeypatch)
        assert (report.first_bad_seq, report.reason) == (
            seq,
            "entry bytes do not match the recorded leaf hash",
        )
    report = verify(ledger, monkeypatch, pinned=pinned)
    # The index is a cache: the next entry's link (or, for the last, the checkpoint) vouches
    # for the entry as it is, so the index is what is wrong.
    assert (report.first_bad_seq, report.reason) == (None, DERIVED)
    witness = "the checkpoint holds" if seq == N - 1 else f"entry {seq + 1} links to"
    assert report.derived == [
        f"index.bin: the leaf hash of entry {seq} does not match the entry "
        f"({witness} the entry as it is)"
    ]
    # With the entry changed too (its successor's link no longer matches), the entry is named.
    start, line = line_at(ledger, seq)
    with entries_file(ledger).open("r+b") as f:
        f.seek(start + line.index(b'"actor":"') + 9)
        f.write(b"Z")
    report = verify(ledger, monkeypatch, pinned=pinned)
    assert report.first_bad_seq == seq
    assert report.reason in (
        "entry bytes do not match the recorded leaf hash",
        "root differs from the checkpoint at this size",
    )
    await ledger.close()


async def test_a_torn_tail(state_dir: Path, chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    ledger, _ = await made(state_dir)
    start, line = line_at(ledger, N - 1)
    with entries_file(ledger).open("r+b") as f:
        f.truncate(start + len(line) // 2)
    report = verify(ledger, monkeypatch)
    assert report.first_bad_seq == N - 1
    assert report.reason == (
        f"the entries file ends before entry {N - 1} (the index holds {N}): "
        "entries from there on are missing"
    )
    await ledger.close()


@pytest.mark.parametrize("seq", [20, 64, N - 2])
async def test_a_line_that_is_not_canonical(
    state_dir: Path, chunk: int, seq: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Keys out of order: still JSON, same length, its leaf hash in the index, yet refused."""
    ledger, _ = await made(state_dir)
    _, line = line_at(ledger, seq)
    fields = json.loads(line)
    swapped = {"body": fields.pop("body"), **fields}
    rewrite_line(
        ledger, seq, json.dumps(swapped, separators=(",", ":"), ensure_ascii=False).encode()
    )
    report = verify(ledger, monkeypatch)
    assert report.first_bad_seq == seq
    assert (
        report.reason
        == "entry does not parse as a canonical entry: entry line is not canonical JSON"
    )
    # Shallow verify does not parse: it stops only at the next entry, whose link broke.
    shallow = verify(ledger, monkeypatch, deep=False)
    assert (shallow.first_bad_seq, shallow.reason) == (
        seq + 1,
        "prev does not link to the previous entry",
    )
    await ledger.close()


@pytest.mark.parametrize(
    ("find", "replace", "why"),
    [
        (b'"v":1}', b'"v":2}', "validation error"),
        (b',"ts":', b',"tz":', "validation error"),
        (b'"seq":', b'"seq":0', "Expecting"),  # a leading zero: not JSON
    ],
)
async def test_a_last_line_with_wrong_fields(
    state_dir: Path,
    chunk: int,
    find: bytes,
    replace: bytes,
    why: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ledger, _ = await made(state_dir)
    _, line = line_at(ledger, N - 1)
    new = line.replace(find, replace)
    if len(new) > len(line):  # keep the length: drop a digit of ts
        at = new.index(b'"ts":') + 6
        new = new[:at] + new[at + 1 :]
    rewrite_line(ledger, N - 1, new)
    report = verify(ledger, monkeypatch)
    assert report.first_bad_seq == N - 1
    assert (report.reason or "").startswith("entry does not parse as a canonical entry: ")
    assert why in (report.reason or "")
    await ledger.close()


async def test_a_line_that_says_another_seq(
    state_dir: Path, chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger, _ = await made(state_dir)
    _, line = line_at(ledger, N - 1)
    rewrite_line(
        ledger, N - 1, line.replace(f'"seq":{N - 1},'.encode(), f'"seq":{N - 2},'.encode())
    )
    report = verify(ledger, monkeypatch)
    assert (report.first_bad_seq, report.reason) == (N - 1, f"entry says seq {N - 2}")
    await ledger.close()


async def test_a_changed_body(state_dir: Path, chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    ledger, entries = await made(state_dir)
    pack = ledger.dir / "bodies.pack"
    at = pack.read_bytes().index(b'"text":"body 0067"')
    patch(pack, at + 9, b"B")
    report = verify(ledger, monkeypatch)
    assert not report.ok
    assert report.first_bad_seq == 67
    assert report.tampered == [entries[67].body]
    assert report.tampered_why == {entries[67].body: "changed"}
    assert report.redacted == [entries[12].body]
    await ledger.close()


async def test_bodies_missing_without_a_witnessed_redaction(
    state_dir: Path, chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One body zeroed and flagged with no `redaction` entry, one record's digest wiped: both
    missing, and a body named by several entries is listed once, at its first entry."""
    ledger, entries = await made(state_dir)
    zeroed, wiped = entries[40].body or "", entries[5].body or ""
    assert [e.seq for e in entries if e.body == wiped][:2] == [5, 16]
    pack = ledger.dir / "bodies.pack"
    data = pack.read_bytes()
    at = data.index(bytes.fromhex(zeroed))
    length, _ = struct.unpack_from("<II", data, at + 32)
    patch(pack, at + 32, struct.pack("<II", length, 1) + bytes(length))  # as `redact` does
    patch(pack, pack.read_bytes().index(bytes.fromhex(wiped)), bytes(32))
    report = verify(ledger, monkeypatch)
    assert not report.ok
    assert report.first_bad_seq == 5
    assert report.tampered == [wiped, zeroed]
    assert report.tampered_why == {
        wiped: "missing (no redaction witnessed)",
        zeroed: "missing (no redaction witnessed)",
    }
    await ledger.close()


@pytest.mark.parametrize("size", [1, 7, 8, 9, 63, 64, 65, 128, N])
async def test_pinned_roots_inside_and_at_the_edges_of_chunks(
    state_dir: Path, chunk: int, size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    ledger, _ = await made(state_dir)
    root = bytes.fromhex(ledger.root(size))
    assert verify(ledger, monkeypatch, pinned=(size, root)).ok
    report = verify(ledger, monkeypatch, pinned=(size, bytes(32)))
    assert (report.first_bad_seq, report.reason) == (
        size - 1,
        "root differs from the checkpoint at this size",
    )
    await ledger.close()


def _field(draw: st.DrawFn, empty: bool) -> str:
    return draw(st.text(min_size=0 if empty else 1, max_size=12))


@st.composite
def lines(draw: st.DrawFn) -> bytes:
    """Canonical lines of valid entries, then perhaps one byte changed."""
    big = st.integers(0, MAX_SAFE_INT)
    line = encode_line(
        seq=draw(big),
        ts=draw(big),
        actor=_field(draw, empty=False),
        kind=_field(draw, empty=False),
        run=draw(st.none() | st.text(max_size=8)),
        parent=draw(st.none() | big),
        body=draw(st.none() | st.binary(min_size=32, max_size=32).map(bytes.hex)),
        prev=draw(st.binary(min_size=32, max_size=32)).hex(),
    )
    if draw(st.booleans()):
        at = draw(st.integers(0, len(line) - 1))
        line = line[:at] + bytes([draw(st.integers(0, 255))]) + line[at + 1 :]
    return line


def _parses(line: bytes) -> bool:
    try:
        Entry.from_line(line)
    except ValueError:
        return False
    return True


@settings(max_examples=400, deadline=None)
@given(lines())
def test_the_bulk_pattern_accepts_only_what_the_parser_accepts(line: bytes) -> None:
    """The pattern may refuse a valid line (the parser then decides), never pass a bad one."""
    matched = lineform.CANONICAL.fullmatch(line + b"\n") is not None
    try:
        line.decode("utf-8")
    except UnicodeDecodeError:
        matched = False
    if matched:
        assert _parses(line)


_NEAR_REDACTION = st.text(alphabet='redactionRE"\\\n\u00e9x', min_size=1, max_size=12)


@settings(max_examples=600, deadline=None)
@given(st.sampled_from(["redaction", "redactio", "redactions", "Redaction", "r"]) | _NEAR_REDACTION)
def test_the_plain_pattern_is_the_canonical_one_without_redaction_entries(kind: str) -> None:
    """`PLAIN` (matched first, so a chunk needs no search for witnesses) accepts exactly the
    lines `CANONICAL` accepts whose kind is not `redaction`, with every near miss of it."""
    line = encode_line(
        seq=3, ts=4, actor="a", kind=kind, run=None, parent=None, body=None, prev="0" * 64
    )
    canonical = lineform.CANONICAL.fullmatch(line + b"\n") is not None
    assert canonical
    assert (lineform.PLAIN.fullmatch(line + b"\n") is not None) == (kind != "redaction")


@pytest.mark.parametrize("kinds", [["note"] * 3, ["note", "redaction", "note"], ["redaction"]])
def test_a_chunk_says_whether_it_holds_a_redaction_entry(kinds: list[str]) -> None:
    chunk = [
        encode_line(
            seq=seq, ts=1, actor="a", kind=kind, run=None, parent=None, body=None, prev="0" * 64
        )
        for seq, kind in enumerate(kinds)
    ]
    assert lineform.FormCheck(0, chunk).result() == (True, "redaction" in kinds)
    assert lineform.FormCheck(1, chunk).result()[0] is False  # seqs that do not match


def test_the_bulk_pattern_accepts_the_lines_the_writer_writes() -> None:
    for actor in ACTORS:
        for run in (None, "", "r\u2028\x00"):
            line = encode_line(
                seq=12, ts=1_700_000_000_000_000, actor=actor, kind="k", run=run,
                parent=None, body="ab" * 32, prev="0" * 64,
            )  # fmt: skip
            assert lineform.CANONICAL.fullmatch(line + b"\n") is not None, line


async def test_a_body_stored_again_after_its_redaction(
    state_dir: Path, chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pack holds the body twice, the old record redacted: the newest record decides."""
    writer = await Ledger.open(state_dir, checkpoint_interval=None)
    for i in range(30):
        await writer.append(actor="t", kind="note", body={"i": i})
    first = await writer.append(actor="t", kind="note", body={"again": True})
    await writer.redact(first.body or "", actor="admin", reason="pii")
    await writer.append(actor="t", kind="note", body={"again": True})
    for i in range(30):
        await writer.append(actor="t", kind="note", body={"j": i})
    await writer.close()
    ledger = await Ledger.open(state_dir, readonly=True, checkpoint_interval=None)
    assert ledger.bodies.read(bytes.fromhex(first.body or ""))[0] is not None
    report = verify(ledger, monkeypatch)
    assert report.ok, report
    await ledger.close()


def test_a_check_that_fails_on_its_thread_says_not_canonical(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The chunk is then walked entry by entry: a failure costs time, never a wrong report."""

    def broken(self: lineform.FormCheck) -> None:
        self.ok = True
        raise MemoryError

    monkeypatch.setattr(lineform.FormCheck, "_check", broken)
    check = lineform.FormCheck(0, [b"{}"] * lineform.THREAD_MIN_LINES)
    assert check.future is not None, "it ran on a kept thread"
    assert check.result() == (False, False)
    assert "canonical-form check failed" in caplog.text
