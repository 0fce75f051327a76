"""The write-ahead journal (`<state>/ledger/wal`): one record per group commit, one fdatasync.

Contract. The journal starts with a base record (where `entries.jsonl` and `bodies.pack` were
fsynced to, and the entry count there), followed by one record per committed batch holding
the pack records and entry lines the batch appends to those files, and the offsets they go to.
A batch is acknowledged once its record is written and fdatasync'ed; its bytes are written to
the record files in the same commit (page cache only: reads see them at once) and fsynced later
at a catch-up, which then rotates the journal to a new base. So, at every instant:

    record files up to the base (fsynced)  +  the journal's complete records
        ⊇  every acknowledged batch

and `Journal.replay` restores the files from the two: it cuts from the files whatever lies past
the journal's last complete record (a batch whose record never completed was never
acknowledged, so nothing of it stays half-present) and writes every record's bytes at its
offsets (idempotent: the same bytes at the same place, never appended twice).

Record: a fixed header `<4sIQQQIII>` (magic, CRC-32 of everything after this field, first seq,
entries offset, pack offset, entry count, entry bytes, pack bytes), then the pack bytes, then the
entry bytes. The base is a record with no entries. A record continues the journal only if its
seq and offsets are where the previous record's end; the first that does not (a torn write, zero
fill, or a stale record of an earlier cycle left past a rotation) ends it.
"""

from __future__ import annotations

import logging
import os
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from daemon import layout
from daemon.ledger.store import open_append, pwrite_all, reopen

MAGIC = b"TWL1"
HEADER = struct.Struct("<4sIQQQIII")
_BODY = struct.Struct("<QQQIII")  # the header after the magic and the CRC, as hashed
JOURNAL = layout.JOURNAL
FILL_STEP = 1 << 20  # zeros written ahead of a new file's records at a time
MAX_BATCH = 1024  # entries in one record (one group commit) at most; open refuses more

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Record:
    """One journal record's header, and where it sits in the journal."""

    at: int
    seq: int
    entries_off: int
    pack_off: int
    count: int
    entries_len: int
    pack_len: int

    @property
    def next_seq(self) -> int:
        return self.seq + self.count

    @property
    def entries_end(self) -> int:
        return self.entries_off + self.entries_len

    @property
    def pack_end(self) -> int:
        return self.pack_off + self.pack_len

    @property
    def end(self) -> int:
        return self.at + HEADER.size + self.pack_len + self.entries_len

    def continues(self, prev: Record) -> bool:
        return (self.seq, self.entries_off, self.pack_off) == (
            prev.next_seq,
            prev.entries_end,
            prev.pack_end,
        )


def header(
    seq: int, entries_off: int, pack_off: int, count: int, pack: bytes, lines: bytes
) -> bytes:
    fields = _BODY.pack(seq, entries_off, pack_off, count, len(lines), len(pack))
    crc = zlib.crc32(lines, zlib.crc32(pack, zlib.crc32(fields)))
    return MAGIC + struct.pack("<I", crc) + fields


def scan(data: bytes) -> list[Record]:
    """The journal's complete, continuous records (the first is its base)."""
    return _scan(lambda size, at: data[at : at + size], len(data))[0]


def _scan(read: Callable[[int, int], bytes], length: int) -> tuple[list[Record], bytes]:
    """Records read one by one with `read(size, offset)` from a journal of `length` bytes
    until the first that is not whole or does not continue; and their payloads, concatenated
    (only whole records are read: a header whose lengths run past the end is not, and its
    payload is never asked for, so a damaged header cannot make a read of gigabytes)."""
    records: list[Record] = []
    payloads: list[bytes] = []
    at = 0
    while True:
        head = read(HEADER.size, at)
        if len(head) < HEADER.size:
            break
        magic, crc, seq, e_off, p_off, count, e_len, p_len = HEADER.unpack(head)
        record = Record(at, seq, e_off, p_off, count, e_len, p_len)
        if magic != MAGIC or (records and not record.continues(records[-1])):
            break
        if record.end > length:
            break
        payload = read(p_len + e_len, at + HEADER.size)
        if len(payload) < p_len + e_len or zlib.crc32(payload, zlib.crc32(head[8:])) != crc:
            break
        records.append(record)
        payloads.append(payload)
        at = record.end
    return records, b"".join(payloads)


def read_records(fd: int) -> tuple[list[Record], bytes]:
    """The journal's complete, continuous records read from `fd`, and their payloads."""
    return _scan(lambda size, at: os.pread(fd, size, at), os.fstat(fd).st_size)


class Journal:
    """The open journal; the writer thread is its only user (see `writer`).

    The file is kept zero-filled ahead of its records, up to `space` bytes, and records
    overwrite it from the start: a commit's fdatasync then has only the record's pages to
    write, no file size (so no filesystem journal commit). Zeros, and records left from an
    earlier cycle, end a scan. A new file is filled FILL_STEP at a time as records reach the
    end of the fill (one size change per step, not per commit, and no 16 MiB write before the
    daemon's first answer); a rotation fills it whole. On a disk too full for that the file
    just grows with its records."""

    def __init__(self, directory: Path, space: int) -> None:
        self.path = directory / JOURNAL
        self.space = space
        self.fd = open_append(self.path, append=False)
        self.end = 0  # where the next record goes: set by `rotate` (open rotates)
        self.filled = os.fstat(self.fd).st_size  # zeros (or old records) up to here
        self.can_fill = True  # False after a full disk refused a fill, until a rotation

    def _fill(self, upto: int) -> None:
        """Zero the file from its end to `upto` (not synced: the next fdatasync takes it)."""
        upto = min(upto, self.space)
        if not self.can_fill or upto <= self.filled:
            return
        try:
            pwrite_all(self.fd, bytes(upto - self.filled), self.filled)
        except OSError as err:  # a full disk: do without (each sync then writes the size)
            log.warning("ledger: cannot zero-fill the journal ahead (%s)", err)
            os.ftruncate(self.fd, self.filled)
            self.can_fill = False
            return
        self.filled = upto

    def records(self) -> tuple[list[Record], bytes]:
        return read_records(self.fd)

    def replay(self, entries_path: Path, pack_path: Path) -> Record | None:
        """Restore the record files from the journal (module doc) and fsync them; None,
        touching nothing, if the journal holds no base or the files end before it (bytes that
        were fsynced are gone: the caller's checks name what is lost, on the evidence as it is).

        The bytes are written whether or not the files seem to hold them already: after a
        failed fsync the page cache may show bytes the disk never got, and only a new write
        makes them dirty again. Their own descriptions, without O_APPEND (where Linux's pwrite
        would append). Returns the last record: the files now end where it does."""
        records, data = self.records()
        if not records:
            return None
        base, last = records[0], records[-1]
        flags = os.O_RDWR | os.O_CLOEXEC
        entries_fd, pack_fd = os.open(entries_path, flags), os.open(pack_path, flags)
        try:
            if (
                os.fstat(entries_fd).st_size < base.entries_off
                or os.fstat(pack_fd).st_size < base.pack_off
            ):
                return None
            os.ftruncate(entries_fd, min(os.fstat(entries_fd).st_size, last.entries_end))
            os.ftruncate(pack_fd, min(os.fstat(pack_fd).st_size, last.pack_end))
            at = 0
            for record in records:  # the base has no payload
                pwrite_all(pack_fd, data[at : at + record.pack_len], record.pack_off)
                at += record.pack_len
                pwrite_all(entries_fd, data[at : at + record.entries_len], record.entries_off)
                at += record.entries_len
            os.fsync(pack_fd)
            os.fsync(entries_fd)
        finally:
            os.close(entries_fd)
            os.close(pack_fd)
        return last

    def append(
        self, seq: int, entries_off: int, pack_off: int, count: int, pack: bytes, lines: bytes
    ) -> None:
        """Write a batch's record (not synced: `sync` is the commit's one fdatasync)."""
        head = header(seq, entries_off, pack_off, count, pack, lines)
        total = len(head) + len(pack) + len(lines)
        if self.end + total > self.filled:
            self._fill(self.end + total + FILL_STEP)
        written = os.pwritev(self.fd, [head, pack, lines], self.end)
        if written < total:  # a short write (a nearly full disk): finish it, or raise
            pwrite_all(self.fd, (head + pack + lines)[written:], self.end + written)
        self.end += total

    def sync(self) -> None:
        os.fdatasync(self.fd)

    def rotate(self, seq: int, entries_off: int, pack_off: int, fill: int | None = None) -> None:
        """Start a new cycle from a base (the record files are fsynced up to it), written over
        the old one at offset 0. The old records after it stay until overwritten: none of them
        continues the new base (their seqs are below it; a rolled-back record was cut), so a
        scan stops there. Zero-fills the file to `fill` (default: `space`) first if it is
        shorter."""
        self.filled = os.fstat(self.fd).st_size
        self.can_fill = True
        self._fill(self.space if fill is None else fill)
        base = header(seq, entries_off, pack_off, 0, b"", b"")
        pwrite_all(self.fd, base, 0)
        os.fdatasync(self.fd)
        self.end = len(base)

    def cut(self, end: int) -> None:
        """Roll back to `end` on a fresh file description, synced (see `writer`: a failed
        fdatasync is never retried on the same description). The file is cut, not zeroed (a
        full disk may refuse the write); the next rotation fills it again."""
        os.ftruncate(self.fd, end)
        reopen(self.fd, self.path, os.O_RDWR)
        os.fdatasync(self.fd)
        self.end = self.filled = end

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
