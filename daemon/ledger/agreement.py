"""How the record files stand against the journal, judged without writing a byte (`compare`).

A commit writes its journal record, then the same bytes to `bodies.pack` and `entries.jsonl`
(page cache), then fdatasyncs the journal; a catch-up fsyncs the record files before it rotates
the journal to a new base (see `writer`). So a crash can leave the record files differing from
the journal in only these ways:
- past the journal's base, the files may lack bytes the journal holds: a file ends early, a page
  the disk never got reads as zeros (a size extended over unwritten blocks), or a page holds only
  its first bytes: `behind`;
- past the journal's last whole record, the files may hold the one batch whose record never
  completed (it was never acknowledged): whole entry lines that continue the seqs and the chain,
  all with one `ts`, at most MAX_BATCH of them, the last possibly torn; body records that hash to
  their names, the last possibly torn; zeros: `ahead` (or `behind` when both).
Only the ledger's owner acts on either, at its open (`Journal.replay`: it writes the journal's
bytes back and cuts the unacknowledged batch). A reader writes nothing: it reads the files up to
what the journal vouches for, and `verify` says what the owner would restore.

Anything else is `differs`: a byte past the base that is neither the journal's nor a crash's
zero, a line past the journal's end that does not continue it, files that do not end a line
where the journal says an entry ends. That is an edit or damage, never a crash: nobody writes
(the owner refuses to open), and the first seq that differs is named, here when the journal
shows it, else by walking the files (`recovery`). Below the base the journal knows nothing:
those bytes were fsynced, and the usual checks judge them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from daemon.ledger.entry import GENESIS_PREV
from daemon.ledger.journal import HEADER, JOURNAL, MAX_BATCH, Record, read_records
from daemon.ledger.merkle import leaf_hash
from daemon.ledger.store import PACK_HEADER, body_digest

PAGE = 4096
TAIL_MAX = 256 << 20  # more than this past the journal's end is no one batch
_LINE_START = b'{"actor":"'  # every canonical entry line starts so (keys are sorted)
_BODY = b'"body":"'
_LOST_BLOCK = bytes(512)  # a sector the disk never got, read back as zeros

State = Literal["none", "same", "ahead", "behind", "differs"]


@dataclass(frozen=True, slots=True)
class Agreement:
    """The outcome of `compare`.

    - none: no journal to go by (none yet; its base damaged: see `reason`; or files that end
      before its base: bytes that were fsynced are gone, and the usual checks name them);
    - same: the files hold exactly what the journal says;
    - ahead: the files also hold an unacknowledged batch past the journal's end;
    - behind: the files lack acknowledged bytes the journal holds, from entry `seq` on;
    - differs: an edit or damage, no crash's shape; `seq` the first entry it touches, if the
      journal shows which (else the caller walks the files).
    """

    state: State
    last: Record | None = None
    seq: int | None = None
    entries_end: int | None = None
    """ahead, behind: where the files' entries are vouched for by the journal (a line's end)."""
    reason: str = ""


def compare(directory: Path, entries_path: Path, pack_path: Path) -> Agreement:
    """Read-only: how the record files stand against the journal (module doc)."""
    try:
        fd = os.open(directory / JOURNAL, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return Agreement("none")
    try:
        records, data = read_records(fd)
        head = os.pread(fd, HEADER.size, 0) if not records else b""
    finally:
        os.close(fd)
    if not records:
        if head.strip(b"\0"):
            return Agreement(
                "none",
                reason="the journal (wal) holds no whole base record (damaged?): the record "
                "files are judged as they are; the daemon's next start writes a new one",
            )
        return Agreement("none")
    entries, pack = _read_only(entries_path), _read_only(pack_path)
    try:
        return _Compare(records, data, entries, pack).run()
    finally:
        for file_fd in (entries, pack):
            if file_fd >= 0:
                os.close(file_fd)


def _read_only(path: Path) -> int:
    """A read-only descriptor, or -1 for a file that does not exist (it holds nothing)."""
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return -1


class _Differs(Exception):
    def __init__(self, seq: int | None, reason: str) -> None:
        super().__init__(reason)
        self.seq = seq
        self.reason = reason


class _Compare:
    def __init__(self, records: list[Record], data: bytes, entries: int, pack: int) -> None:
        self.records, self.data = records, data
        self.entries, self.pack = entries, pack
        self.entries_size = os.fstat(entries).st_size if entries >= 0 else 0
        self.pack_size = os.fstat(pack).st_size if pack >= 0 else 0
        self.behind: tuple[int, int] | None = None  # (first seq the files lack, its line start)

    def run(self) -> Agreement:
        base, last = self.records[0], self.records[-1]
        if self.entries_size < base.entries_off or self.pack_size < base.pack_off:
            return Agreement(
                "none",
                last,
                reason="the record files end before the journal's base (bytes that were "
                "fsynced are gone): they are judged as they are",
            )
        try:
            at = 0
            for record in self.records:
                bodies = self.data[at : at + record.pack_len]
                at += record.pack_len
                lines = self.data[at : at + record.entries_len]
                at += record.entries_len
                self._record(record, bodies, lines)
            ahead = self._tails(last)
        except _Differs as differs:
            return Agreement("differs", last, differs.seq, reason=differs.reason)
        if self.behind is not None:
            seq, end = self.behind
            return Agreement(
                "behind",
                last,
                seq,
                end,
                reason=f"the record files end before seq {seq}; the journal holds entries up "
                f"to seq {last.next_seq - 1} that were never written back to them (the daemon "
                "stopped before its write-back: a crash or a power loss)",
            )
        if ahead:
            return Agreement(
                "ahead",
                last,
                last.next_seq,
                last.entries_end,
                reason=f"the record files hold an unacknowledged batch past seq "
                f"{last.next_seq - 1} (a crash during its commit): it is not part of the record",
            )
        return Agreement("same", last)

    def _record(self, record: Record, bodies: bytes, lines: bytes) -> None:
        if record.pack_len:
            got = os.pread(self.pack, record.pack_len, record.pack_off) if self.pack >= 0 else b""
            if got != bodies:
                gap, crash = _gap(got, bodies, record.pack_off)
                seq, start = _body_entry(record, bodies, lines, gap)
                if not crash:
                    raise _Differs(
                        seq,
                        f"bodies.pack differs from the journal at byte {record.pack_off + gap} "
                        f"(the body of entry {seq}): edited or damaged, no crash leaves that",
                    )
                self._lacks(seq, record.entries_off + start)
        if record.entries_len:
            got = (
                os.pread(self.entries, record.entries_len, record.entries_off)
                if self.entries >= 0
                else b""
            )
            if got != lines:
                gap, crash = _gap(got, lines, record.entries_off)
                seq = record.seq + lines.count(b"\n", 0, gap)
                if not crash:
                    raise _Differs(
                        seq,
                        f"entries.jsonl differs from the journal's copy of entry {seq}: edited "
                        "or damaged, no crash leaves that",
                    )
                self._lacks(seq, record.entries_off + lines.rfind(b"\n", 0, gap) + 1)

    def _lacks(self, seq: int, start: int) -> None:
        if self.behind is None or seq < self.behind[0]:
            self.behind = (seq, start)

    def _tails(self, last: Record) -> bool:
        """Check what the files hold past the journal's end; True if they hold anything."""
        ahead = False
        if self.entries_size > last.entries_end:
            self._entries_tail(last)
            ahead = True
        if self.pack_size > last.pack_end:
            self._pack_tail(last)
            ahead = True
        return ahead

    def _entries_tail(self, last: Record) -> None:
        start, fd = last.entries_end, self.entries
        if start and os.pread(fd, 1, start - 1) != b"\n":
            raise _Differs(
                None,
                f"entries.jsonl does not end a line at byte {start}, where the journal says "
                f"entry {last.next_seq - 1} ends: lines before it changed length",
            )
        if self.entries_size - start > TAIL_MAX:
            raise _Differs(last.next_seq, _past(last, "more bytes than any one batch"))
        tail = os.pread(fd, self.entries_size - start, start).rstrip(b"\0")
        lines = tail.split(b"\n")
        partial = lines.pop()
        prev = _previous_leaf(fd, start)
        stamp = None
        for k, line in enumerate(lines[: MAX_BATCH + 1]):
            seq = last.next_seq + k
            if k == MAX_BATCH:
                raise _Differs(seq, _past(last, f"more than {MAX_BATCH} lines, no one batch"))
            at = line.find(b',"seq":')
            if not line.startswith(_LINE_START) or not line.startswith(
                f',"seq":{seq},"ts":'.encode(), at
            ):
                raise _Differs(seq, _past(last, f"the line there is not entry {seq}"))
            ts = line[at:].split(b",", 3)[2]
            stamp = ts if stamp is None else stamp
            if ts != stamp:  # the journal lost a record (or lines were added): say where
                raise _Differs(last.next_seq, _past(last, "lines of more than one batch"))
            if prev is not None and f'"prev":"{prev}"'.encode() not in line:
                raise _Differs(seq, _past(last, f"entry {seq} does not link to the one before"))
            prev = leaf_hash(line).hex()
        if partial and not (partial.startswith(_LINE_START) or _LINE_START.startswith(partial)):
            raise _Differs(last.next_seq + len(lines), _past(last, "a torn line no entry begins"))

    def _pack_tail(self, last: Record) -> None:
        """Body records past the journal's end: whole ones hash to their names (or lost a
        block to zeros), the last may be torn, zeros may follow; nothing else."""
        start, fd, size = last.pack_end, self.pack, self.pack_size
        if size - start > TAIL_MAX:
            raise _Differs(last.next_seq, _pack_past(start, "more bytes than any one batch"))
        offset = start
        while offset < size:
            head = os.pread(fd, PACK_HEADER.size, offset)
            if not os.pread(fd, size - offset, offset).strip(b"\0"):
                return  # zeros to the end: blocks the disk never got
            if len(head) < PACK_HEADER.size:
                raise _Differs(last.next_seq, _pack_past(offset, "a piece of a record header"))
            digest, length, flags = PACK_HEADER.unpack(head)
            if flags or length > TAIL_MAX:
                raise _Differs(last.next_seq, _pack_past(offset, "no body record's header"))
            end = offset + PACK_HEADER.size + length
            if end > size:
                return  # a torn last record
            data = os.pread(fd, length, offset + PACK_HEADER.size)
            if body_digest(data) != digest and _LOST_BLOCK not in data:
                raise _Differs(
                    last.next_seq, _pack_past(offset, "a body record that is not its body")
                )
            offset = end


def _past(last: Record, what: str) -> str:
    return (
        f"entries.jsonl holds, past the journal's last entry (seq {last.next_seq - 1}), {what}: "
        "edited or damaged, no crash leaves that"
    )


def _pack_past(offset: int, what: str) -> str:
    return (
        f"bodies.pack holds, at byte {offset} past the journal's end, {what}: edited or "
        "damaged, no crash leaves that"
    )


def _gap(got: bytes, want: bytes, offset: int) -> tuple[int, bool]:
    """Where `got` (the file's bytes at `offset`) first differs from `want` (the journal's),
    and whether every difference is a crash's: pages (aligned as in the file) that are zeros,
    or hold only their first bytes, and a file that ends early."""
    first = len(got) if len(got) < len(want) else -1
    page = PAGE - offset % PAGE
    start = 0
    while start < len(got):
        stop = min(start + page, len(got))
        mine, theirs = got[start:stop], want[start:stop]
        if mine != theirs:
            if first < 0 or start < first:
                pairs = enumerate(zip(mine, theirs, strict=True))
                first = start + next(i for i, (a, b) in pairs if a != b)
            if not theirs.startswith(mine.rstrip(b"\0")):
                return first, False
        start, page = stop, PAGE
    return first, True


def _body_entry(record: Record, bodies: bytes, lines: bytes, gap: int) -> tuple[int, int]:
    """The entry of `record` whose body's pack record covers byte `gap` of the record's pack
    bytes, and where its line starts in `lines` (the record's first entry if none names it)."""
    at = 0
    while at + PACK_HEADER.size <= len(bodies):
        digest, length, _ = PACK_HEADER.unpack_from(bodies, at)
        end = at + PACK_HEADER.size + length
        if at <= gap < end:
            found = lines.find(_BODY + digest.hex().encode())
            if found >= 0:
                start = lines.rfind(b"\n", 0, found) + 1
                return record.seq + lines.count(b"\n", 0, start), start
            break
        at = end
    return record.seq, 0


def _previous_leaf(fd: int, end: int) -> str | None:
    """The leaf hash of the line that ends at byte `end` (GENESIS_PREV at 0); None if it is
    longer than we look back (then the link is not checked)."""
    if end == 0:
        return GENESIS_PREV
    back = min(end, 1 << 20)
    window = os.pread(fd, back - 1, end - back)
    at = window.rfind(b"\n")
    if at < 0 and back < end:
        return None
    return leaf_hash(window[at + 1 :]).hex()
