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

import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

from daemon.ledger.store import open_append, pwrite_all, reopen

MAGIC = b"TWL1"
HEADER = struct.Struct("<4sIQQQIII")
_BODY = struct.Struct("<QQQIII")  # the header after the magic and the CRC, as hashed
JOURNAL = "wal"


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
    records: list[Record] = []
    at = 0
    while at + HEADER.size <= len(data):
        magic, crc, seq, e_off, p_off, count, e_len, p_len = HEADER.unpack_from(data, at)
        payload_end = at + HEADER.size + p_len + e_len
        if magic != MAGIC or payload_end > len(data):
            break
        record = Record(at, seq, e_off, p_off, count, e_len, p_len)
        if records and not record.continues(records[-1]):
            break
        fields = data[at + 8 : at + HEADER.size]
        if zlib.crc32(data[at + HEADER.size : payload_end], zlib.crc32(fields)) != crc:
            break
        records.append(record)
        at = payload_end
    return records


class Journal:
    """The open journal; the writer thread is its only user (see `writer`)."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / JOURNAL
        self.fd = open_append(self.path, append=False)
        self.end = os.fstat(self.fd).st_size

    def records(self) -> tuple[bytes, list[Record]]:
        data = os.pread(self.fd, self.end, 0)
        return data, scan(data)

    def replay(self, entries_path: Path, pack_path: Path) -> Record | None:
        """Restore the record files from the journal (module doc) and fsync them; None,
        touching nothing, if the journal holds no base or the files end before it (bytes that
        were fsynced are gone: the caller's checks name what is lost, on the evidence as it is).

        The bytes are written whether or not the files seem to hold them already: after a
        failed fsync the page cache may show bytes the disk never got, and only a new write
        makes them dirty again. Their own descriptions, without O_APPEND (where Linux's pwrite
        would append). Returns the last record: the files now end where it does."""
        data, records = self.records()
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
            for record in records[1:]:
                payload = record.at + HEADER.size
                pwrite_all(pack_fd, data[payload : payload + record.pack_len], record.pack_off)
                lines = payload + record.pack_len
                pwrite_all(entries_fd, data[lines : lines + record.entries_len], record.entries_off)
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
        written = os.pwritev(self.fd, [head, pack, lines], self.end)
        if written < total:  # a short write (a nearly full disk): finish it, or raise
            pwrite_all(self.fd, (head + pack + lines)[written:], self.end + written)
        self.end += total

    def sync(self) -> None:
        os.fdatasync(self.fd)

    def rotate(self, seq: int, entries_off: int, pack_off: int) -> None:
        """Start a new cycle from a base (the record files are fsynced up to it): the base is
        written over the old one at offset 0 and the rest cut. A crash between the write and
        the cut leaves old records after the new base, which do not continue it (see `scan`)."""
        base = header(seq, entries_off, pack_off, 0, b"", b"")
        pwrite_all(self.fd, base, 0)
        os.ftruncate(self.fd, len(base))
        os.fdatasync(self.fd)
        self.end = len(base)

    def cut(self, end: int) -> None:
        """Roll back to `end` on a fresh file description, synced (see `writer`: a failed
        fdatasync is never retried on the same description)."""
        os.ftruncate(self.fd, end)
        reopen(self.fd, self.path, os.O_RDWR)
        os.fdatasync(self.fd)
        self.end = end

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
