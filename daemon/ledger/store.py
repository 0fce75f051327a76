"""On-disk structures derived from the entries file, and the bodies pack.

One file (past 500 lines) for the ledger's storage formats: the record/column files, the tree
over them and the body pack + table share the same write, sync and recovery helpers.

Derived files (rebuilt from the entries when missing, so they are caches, not the record, and
checked rather than trusted: open recomputes the tree nodes past the last signed checkpoint,
proofs are checked against the root before they are served, and `verify` compares every stored
record with the entries; see `Tree.recheck` and `audit`):
- `index.bin`: per entry 40 bytes, its leaf hash and the end offset of its line;
- `tree/level-NN.bin`: per complete, aligned subtree of 2**NN leaves its 32-byte hash, so any
  aligned subtree (and so any proof or root) costs O(log n) reads;
- `bodies.idx`: an open-addressing hash table from body hash to its record in the pack.
They are written after the entries' fsync and fsynced only at `sync` (checkpoints, close, every
`SYNC_EVERY` entries); `meta.json` names how far they were fsynced, and open trusts them up to
there and recomputes the rest from the entries / pack tail. Nothing is held per entry in memory:
records are read with `pread` (a read-only opener keeps its recomputed tail in memory).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import mmap
import os
import struct
import sys
import threading
from pathlib import Path
from typing import Any

from daemon import layout
from daemon.files import create_dir as create_dir
from daemon.files import fsync_dir
from daemon.files import write_atomic as write_atomic  # the ledger modules import it from here
from daemon.ledger import packscan
from daemon.ledger.merkle import EMPTY_ROOT, Frontier, node_hash, split_point

log = logging.getLogger(__name__)

INDEX_RECORD = 40
NODE_RECORD = 32
_END = struct.Struct("<Q")
INDEX_END = _END  # an index record: the leaf hash, then this (the line's end offset)
_RECORD = struct.Struct("<32sQ")
INDEX_ENTRY = _RECORD  # an index.bin record: leaf hash, end offset (`audit` reads it too)
FLUSH_BYTES = 1 << 16  # the writer's per-batch flush leaves smaller buffers in memory
RECHECK_CHUNK = 1 << 16  # leaves per read when recomputing stored nodes


def open_append(path: Path, append: bool = True) -> int:
    """Open for writing, fsyncing the file and its directory if it had to be created.

    Files that are also patched in place must not be O_APPEND: Linux pwrite appends there.
    """
    existed = path.exists()
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | (os.O_APPEND if append else 0)
    fd = os.open(path, flags, 0o600)
    if not existed:
        os.fsync(fd)
        fsync_dir(path.parent)
    return fd


def write_all(fd: int, data: bytes | bytearray | memoryview) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def pwrite_all(fd: int, data: bytes | bytearray | memoryview, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n


def pread_exact(fd: int, size: int, offset: int) -> bytes:
    data = os.pread(fd, size, offset)
    if len(data) != size:
        raise OSError(f"short read at {offset}: wanted {size}, got {len(data)}")
    return data


def reopen(fd: int, path: Path, flags: int) -> None:
    """Point `fd` at a fresh open file description of `path`, atomically (dup2).

    After a failed fsync the old description has consumed the error, so a later fsync on it
    could report success for pages that never reached the disk. Readers on other threads keep
    using the same fd number, which never refers to anything else in between.
    """
    fresh = os.open(path, flags | os.O_CLOEXEC)
    try:
        os.dup2(fresh, fd, inheritable=False)
    finally:
        os.close(fresh)


class Column:
    """A file of fixed-size records; records not yet on disk live in `mem`.

    `(disk, mem)` is one attribute swapped whole by `flush`, so a reader on another thread
    (the loop, while the writer thread flushes) never pairs a new `disk` with the old `mem`.
    """

    def __init__(self, path: Path, record: int, writable: bool, trusted: int) -> None:
        self.path = path
        self.record = record
        self.writable = writable
        self.fd: int | None = None
        if writable:
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        elif path.exists():
            self.fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        on_disk = os.fstat(self.fd).st_size // record if self.fd is not None else 0
        disk = min(on_disk, trusted)
        self._view: tuple[int, bytearray] = (disk, bytearray())
        # A read-only opener's corrections (see `patch`), seen by `read` and not `read_range`:
        # what `verify` compares is the file as it is.
        self.fixes: dict[int, bytes] = {}
        if writable and on_disk != disk:
            os.ftruncate(self.fd, disk * record)  # type: ignore[arg-type]

    @property
    def disk(self) -> int:
        return self._view[0]

    @property
    def mem(self) -> bytearray:
        return self._view[1]

    @property
    def count(self) -> int:
        disk, mem = self._view
        return disk + len(mem) // self.record

    def read(self, i: int) -> bytes:
        disk, mem = self._view
        if i < disk:
            if self.fixes and i in self.fixes:
                return self.fixes[i]
            assert self.fd is not None
            return pread_exact(self.fd, self.record, i * self.record)
        at = (i - disk) * self.record
        if not 0 <= at < len(mem):
            raise IndexError(i)
        return bytes(mem[at : at + self.record])

    def read_range(self, start: int, stop: int) -> bytes:
        """Records [start, stop) as one bytes object (used by scans)."""
        disk, mem = self._view
        parts = []
        if start < disk:
            assert self.fd is not None
            end = min(stop, disk)
            parts.append(pread_exact(self.fd, (end - start) * self.record, start * self.record))
            start = end
        if start < stop:
            a, b = (start - disk) * self.record, (stop - disk) * self.record
            parts.append(bytes(mem[a:b]))
        return b"".join(parts)

    def append(self, data: bytes) -> None:
        self._view[1].extend(data)

    def patch(self, i: int, data: bytes) -> None:
        """Correct record i: in the file (writable) or in memory (a read-only opener)."""
        disk, mem = self._view
        if i >= disk:
            at = (i - disk) * self.record
            mem[at : at + self.record] = data
        elif self.writable:
            assert self.fd is not None
            pwrite_all(self.fd, data, i * self.record)
        else:
            self.fixes[i] = data

    def flush(self) -> None:
        disk, mem = self._view
        if self.writable and mem:
            assert self.fd is not None
            pwrite_all(self.fd, mem, disk * self.record)
            self._view = (disk + len(mem) // self.record, bytearray())

    def truncate(self, n: int) -> None:
        disk, mem = self._view
        if n >= self.count:
            return
        if n >= disk:
            self._view = (disk, mem[: (n - disk) * self.record])
            return
        self._view = (n, bytearray())
        if self.writable:
            assert self.fd is not None
            # Best effort: records left past the count are overwritten by the next flush and
            # cut at open (which trusts only `meta.json`'s size), so a failure here (a disk
            # gone bad while rolling a batch back) leaves nothing wrong behind.
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, n * self.record)

    def sync(self) -> None:
        if self.writable and self.fd is not None:
            os.fsync(self.fd)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class Tree:
    """Leaf index + per-level complete-subtree hashes + the in-memory frontier."""

    def __init__(self, root: Path, writable: bool, trusted: int) -> None:
        self.dir = root / layout.TREE
        self.writable = writable
        if writable:
            create_dir(self.dir)
        self.index = Column(root / layout.INDEX, INDEX_RECORD, writable, trusted)
        self.levels: list[Column] = [self.index]  # levels[0] is a view on the index
        n = self.index.count
        level = 1
        while n >> level:
            self._open_level(level, n >> level)
            level += 1
        if any(column.count != n >> k for k, column in enumerate(self.levels)):
            # A level file is missing or short: rebuild everything from the entries.
            for column in self.levels:
                column.truncate(0)
        self.frontier = self._load_frontier(self.size)

    def _open_level(self, level: int, trusted: int) -> Column:
        column = Column(self.dir / layout.tree_level(level), NODE_RECORD, self.writable, trusted)
        self.levels.append(column)
        return column

    @property
    def size(self) -> int:
        return self.index.count

    def leaf(self, i: int) -> bytes:
        return self.index.read(i)[:32]

    def end(self, i: int) -> int:
        """End offset (after the newline) of entry i's line; 0 for i = -1."""
        if i < 0:
            return 0
        return int(_END.unpack_from(self.index.read(i), 32)[0])

    def span(self, i: int) -> tuple[int, int]:
        return self.end(i - 1), self.end(i)

    def node(self, level: int, i: int) -> bytes:
        if level == 0:
            return self.leaf(i)
        return self.levels[level].read(i)

    def subtree(self, start: int, end: int) -> bytes:
        n = end - start
        if n & (n - 1) == 0 and start % n == 0:
            return self.node(n.bit_length() - 1, start // n)
        k = split_point(n)
        return node_hash(self.subtree(start, start + k), self.subtree(start + k, end))

    def root(self, size: int | None = None) -> bytes:
        size = self.size if size is None else size
        if size == self.size:
            return self.frontier.root()
        return self.subtree(0, size) if size else EMPTY_ROOT

    def _load_frontier(self, size: int) -> Frontier:
        nodes, start = [], 0
        for level in range(size.bit_length() - 1, -1, -1):
            if size >> level & 1:
                nodes.append(self.node(level, start >> level))
                start += 1 << level
        return Frontier(size, nodes)

    def append(self, leaf: bytes, end: int) -> None:
        for level, _, digest in self.frontier.push(leaf):
            if level == 0:
                self.index.append(leaf + _END.pack(end))
            else:
                column = self.levels[level] if level < len(self.levels) else None
                if column is None:
                    column = self._open_level(level, 0)
                column.append(digest)

    def extend(self, leaves: list[bytes], ends: list[int]) -> None:
        """`append` for a batch: one pass over the frontier, one buffer append per level."""
        nodes = self.frontier.push_many(leaves)
        self.index.append(b"".join(map(_RECORD.pack, leaves, ends)))
        by_level: dict[int, list[bytes]] = {}
        for level, digest in nodes:
            by_level.setdefault(level, []).append(digest)
        for level in sorted(by_level):
            column = self.levels[level] if level < len(self.levels) else None
            if column is None:
                column = self._open_level(level, 0)
            column.append(b"".join(by_level[level]))

    def flush(self, force: bool = True) -> None:
        """Write the buffered records; unless `force`, only buffers past `FLUSH_BYTES`."""
        for column in self.levels:
            if force or len(column.mem) >= FLUSH_BYTES:
                column.flush()

    def truncate(self, n: int, frontier: Frontier | None = None) -> None:
        """Drop leaves from n on; `frontier` (the one at n, if the caller kept it) saves
        reading it back from the stored nodes."""
        for level, column in enumerate(self.levels):
            column.truncate(n >> level)
        self.frontier = frontier if frontier is not None else self._load_frontier(n)

    def recheck(self, start: int) -> tuple[list[tuple[int, int]], Frontier]:
        """Recompute the interior nodes that leaves [start, size) complete, from those leaves
        and the stored frontier at `start`, and correct every stored node that differs (see
        `Column.patch`). Returns the corrected (level, index) pairs and the recomputed frontier
        (the caller decides whether to adopt it). O(size - start) leaf reads and hashes; the
        caller vouches for the stored frontier at `start` (a signed checkpoint's size, or 0)."""
        size = self.size
        frontier = self._load_frontier(start)
        fixed: list[tuple[int, int]] = []
        seq = start
        while seq < size:
            stop = min(size, seq + RECHECK_CHUNK)
            index = self.index.read_range(seq, stop)
            leaves = [index[i : i + 32] for i in range(0, len(index), INDEX_RECORD)]
            by_level: dict[int, list[bytes]] = {}
            for level, digest in frontier.push_many(leaves):
                by_level.setdefault(level, []).append(digest)
            for level, digests in by_level.items():
                # The first node a chunk completes on a level is the one holding its first leaf.
                fixed += self._correct(level, seq >> level, digests)
            seq = stop
        return fixed, frontier

    def _correct(self, level: int, first: int, digests: list[bytes]) -> list[tuple[int, int]]:
        while level >= len(self.levels):
            self._open_level(len(self.levels), 0)
        column = self.levels[level]
        stored = b""
        with contextlib.suppress(OSError):
            stored = column.read_range(first, first + len(digests))
        if stored == b"".join(digests) and not column.fixes:
            return []
        fixed = []
        for k, digest in enumerate(digests):
            i = first + k
            try:
                same = column.read(i) == digest
            except (OSError, IndexError):
                same = False
            if not same:
                column.patch(i, digest)
                fixed.append((level, i))
        return fixed

    def sync(self) -> None:
        self.flush()
        for column in self.levels:
            column.sync()

    def close(self) -> None:
        for column in self.levels:
            column.close()


# ---- bodies ---------------------------------------------------------------------------------

# The pack's record header and the table's slot, declared once in `packscan` (whose child
# process runs on the standard library alone, so it cannot import them from here).
PACK_HEADER = packscan.PACK_HEADER  # body hash, length, flags
REDACTED = packscan.REDACTED
_SLOT = packscan.SLOT  # hash prefix, pack offset + 1 (0 = empty)

if sys.byteorder != "little":  # `_words` reads the table's little-endian words in place
    raise ImportError("tally's ledger reads its body table in place: it needs a little-endian CPU")


def _words(table: mmap.mmap | bytearray) -> memoryview:
    """The table as 64-bit words, two per slot (prefix at 2i, offset + 1 at 2i + 1): indexing
    a word costs about half of unpacking a slot, and the writer probes twice per new body."""
    return memoryview(table).cast("Q")


class TableFull(RuntimeError):
    """`bodies.idx` has no empty slot, which the writer never lets happen (it grows at half
    full): the file was damaged, or its count in meta.json is wrong. Probes stop after one lap
    instead of looping; an insert raises this, and the writer refuses further appends."""

    def __init__(self, path: Path) -> None:
        super().__init__(f"{path} has no empty slot: the file is damaged (remove it to rebuild)")


INITIAL_SLOTS = 1 << 14


class BodyStore:
    """Content-addressed bodies: an append-only pack plus a hash table over it.

    Pack record: 32-byte SHA-256 of the body's canonical JSON, u32 length, u32 flags, the bytes.
    Redaction zeroes the bytes in place and sets the REDACTED flag, so the record (and the fact
    that a body existed) stays while its content is gone.
    """

    def __init__(self, root: Path, writable: bool, table_mark: int, table_count: int) -> None:
        self.writable = writable
        # Guards the table's mapping and the pack's records against a reader on another thread
        # while the writer swaps or rewrites them. Held only for memory operations and preads:
        # the writer builds a grown table and fsyncs outside it. Reentrant: `rebuild_table`
        # inserts (and may grow) while holding it.
        self.lock = threading.RLock()
        self.pack_path, self.table_path = root / layout.BODIES_PACK, root / layout.BODIES_TABLE
        pack_path = self.pack_path
        if writable:
            self.pack = open_append(pack_path, append=False)
        elif pack_path.exists():
            self.pack = os.open(pack_path, os.O_RDONLY | os.O_CLOEXEC)
        else:
            self.pack = -1
        self.pack_size = os.fstat(self.pack).st_size if self.pack >= 0 else 0
        self.extra: dict[bytes, list[int]] = {}  # read-only opener: records past the table
        self.table = -1
        self.map: mmap.mmap | None = None  # the table, mapped: probes cost no syscalls
        self.words: memoryview | None = None  # the map, as `_words`
        self.slots = 0
        self.count = table_count
        mark = table_mark
        if self.table_path.exists():
            flags = os.O_RDWR if writable else os.O_RDONLY
            self.table = os.open(self.table_path, flags | os.O_CLOEXEC)
            self.slots = os.fstat(self.table).st_size // _SLOT.size
        self.lost = mark > self.pack_size
        """The pack is shorter than when the table was synced: acknowledged bodies are gone.
        Nothing is touched (no rescan, no truncation); the ledger refuses to open."""
        if self.lost:
            if self.slots and not self.slots & (self.slots - 1):
                self._map()
            self.mark = mark
            self.pending = bytearray()
            self.unindexed: list[tuple[bytes, int]] = []
            return
        # Nothing trusted (mark 0: no meta.json) means a new table: an old one may hold slots
        # of records a crash or a truncation removed, and more of them than `count` says.
        untrusted = mark == 0 and self.slots > 0 and writable
        if untrusted or self.slots == 0 or self.slots & (self.slots - 1) or mark > self.pack_size:
            mark, self.count = 0, 0
            if writable:
                self._new_table(INITIAL_SLOTS)
            else:
                if self.table >= 0:
                    os.close(self.table)
                self.table, self.slots = -1, 0
        else:
            if writable:
                self._allocate()
            self._map()
        self.mark = mark
        self.pending = bytearray()  # staged records, written by `write`
        self.unindexed = []  # (digest, offset) of records staged or written, not in the table
        self._scan_tail(mark)

    # -- table --
    def _map(self) -> None:
        access = mmap.ACCESS_WRITE if self.writable else mmap.ACCESS_READ
        self.map = mmap.mmap(self.table, self.slots * _SLOT.size, access=access)
        self.words = _words(self.map)

    def _unmap(self) -> None:
        if self.words is not None:
            self.words.release()  # a map with a view still open cannot be closed
            self.words = None
        if self.map is not None:
            self.map.close()
            self.map = None

    def _allocate(self) -> None:
        """Give the mapped table real blocks: storing into a hole of a mapped file on a full
        disk is a SIGBUS (the process dies), where a write would only have failed."""
        try:
            os.posix_fallocate(self.table, 0, self.slots * _SLOT.size)
        except OSError as err:
            log.warning("ledger: cannot allocate bodies.idx (%s); a full disk may crash", err)

    def _new_table(self, slots: int) -> None:
        self._unmap()
        if self.table >= 0:
            os.close(self.table)
            self.table = -1
        fd = os.open(self.table_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            write_all(fd, bytes(slots * _SLOT.size))  # written, not a hole (see _allocate)
        except BaseException:
            os.close(fd)
            raise
        self.table, self.slots, self.count = fd, slots, 0
        self._map()

    def reserve(self, records: int) -> None:
        """Grow the table now if `records` more could overfill it, so that `index`, which runs
        after the batch is durable, does no I/O and cannot fail."""
        while (self.count + records) * 2 > self.slots:
            self._grow()

    # Probes walk a chain of slots from the body's home slot to the first empty one; a full lap
    # (a damaged table with no empty slot) ends one too.
    def _table_offsets(self, digest: bytes) -> list[int]:
        words = self.words
        if words is None:
            return []
        prefix = int.from_bytes(digest[:8], "little") or 1
        mask = self.slots - 1
        i = home = prefix & mask
        found: list[int] = []
        while words[2 * i + 1]:
            if words[2 * i] == prefix:
                found.append(words[2 * i + 1] - 1)
            i = (i + 1) & mask
            if i == home:
                break
        return found

    def _insert(self, digest: bytes, offset: int) -> None:
        if not self.writable:
            self.extra.setdefault(digest, []).append(offset)
            return
        self._insert_many([(digest, offset)])

    def _insert_many(self, records: list[tuple[bytes, int]]) -> None:
        """Enter records into a writable table (skipping one already there: written before a
        crash). The prefix is stored before the offset: a slot is taken once its offset is
        set, so a page written back between the two stores shows an empty slot."""
        while (self.count + len(records)) * 2 > self.slots:
            self._grow()
        words = self.words
        assert words is not None
        mask = self.slots - 1
        for digest, offset in records:
            prefix = int.from_bytes(digest[:8], "little") or 1
            i = home = prefix & mask
            while words[2 * i + 1]:
                if words[2 * i] == prefix and words[2 * i + 1] == offset + 1:
                    break
                i = (i + 1) & mask
                if i == home:
                    raise TableFull(self.table_path)
            else:
                words[2 * i] = prefix
                words[2 * i + 1] = offset + 1
                self.count += 1

    def _grow(self) -> None:
        """Rehash into a table twice the size, built in memory and written and fsynced to a
        new file outside the lock (the writer thread is the table's only mutator, so the old
        mapping holds still meanwhile), then swapped in under the lock."""
        assert self.map is not None
        slots = self.slots * 2
        mask = slots - 1
        data = bytearray(slots * _SLOT.size)
        words = _words(data)
        count = 0
        for key, off in _SLOT.iter_unpack(self.map):
            if off:
                i = key & mask
                while words[2 * i + 1]:
                    i = (i + 1) & mask
                words[2 * i], words[2 * i + 1] = key, off
                count += 1
        words.release()
        tmp = self.table_path.with_name("bodies.idx.tmp")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            write_all(fd, data)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                tmp.unlink()  # a full disk must get its space back
            raise
        access = mmap.ACCESS_WRITE if self.writable else mmap.ACCESS_READ
        grown = mmap.mmap(fd, slots * _SLOT.size, access=access)
        with self.lock:
            os.replace(tmp, self.table_path)
            old_map, old_words, old_fd = self.map, self.words, self.table
            self.map, self.words, self.table = grown, _words(grown), fd
            self.slots, self.count = slots, count
        if old_words is not None:
            old_words.release()
        old_map.close()
        os.close(old_fd)

    def _scan_tail(self, start: int) -> None:
        """Index pack records from `start`; drop (or ignore, read-only) a torn last record."""
        offset = start
        while offset + PACK_HEADER.size <= self.pack_size:
            digest, length, _ = PACK_HEADER.unpack(pread_exact(self.pack, PACK_HEADER.size, offset))
            if offset + PACK_HEADER.size + length > self.pack_size:
                break
            self._insert(digest, offset)
            offset += PACK_HEADER.size + length
        if offset != self.pack_size:
            if self.writable:
                os.ftruncate(self.pack, offset)
                os.fsync(self.pack)
            self.pack_size = offset

    # -- records --
    def locate(self, digest: bytes) -> tuple[int, int, int] | None:
        """(offset, length, flags) of the newest record of this body, or None."""
        with self.lock:
            best: tuple[int, int, int] | None = None
            for off in self._table_offsets(digest) + self.extra.get(digest, []):
                if off + PACK_HEADER.size > self.pack_size:
                    continue
                h, length, flags = PACK_HEADER.unpack(pread_exact(self.pack, PACK_HEADER.size, off))
                if off + PACK_HEADER.size + length > self.pack_size:
                    continue  # a record cut short
                if h == digest and (best is None or off > best[0]):
                    best = (off, length, flags)
            return best

    def read(self, digest: bytes) -> tuple[bytes | None, bool]:
        """(bytes, redacted): bytes None when missing or redacted. Under the lock, so a
        redaction is seen whole or not at all (never its zeroes without its flag)."""
        with self.lock:
            where = self.locate(digest)
            if where is None:
                return None, False
            off, length, flags = where
            if flags & REDACTED:
                return None, True
            return pread_exact(self.pack, length, off + PACK_HEADER.size), False

    def has_live(self, digest: bytes) -> bool:
        words = self.words
        if words is not None and not self.extra:
            # The writer's common case, a new body: its probe chain in the mapped table holds
            # no slot with its prefix. No lock, no read of the pack (the writer thread is the
            # table's only mutator).
            prefix = int.from_bytes(digest[:8], "little") or 1
            mask = self.slots - 1
            i = home = prefix & mask
            while words[2 * i + 1]:
                if words[2 * i] == prefix:
                    break
                i = (i + 1) & mask
                if i == home:
                    break
            else:
                return False
        where = self.locate(digest)
        return where is not None and not where[2] & REDACTED

    def stage(self, digest: bytes, data: bytes) -> None:
        """Queue a record for the next `write` (the writer thread only)."""
        self.unindexed.append((digest, self.pack_size + len(self.pending)))
        self.pending += PACK_HEADER.pack(digest, len(data), 0) + data

    def write(self) -> None:
        """Append the staged records (not fsynced: the caller syncs with the entries).

        They are found by `locate` only after `index` (the writer calls it once the batch is
        durable; until it is acknowledged nothing refers to them).
        """
        if not self.pending:
            return
        pwrite_all(self.pack, self.pending, self.pack_size)
        self.pack_size += len(self.pending)
        self.pending = bytearray()

    def index(self) -> None:
        """Enter the records written by `write` into the table."""
        with self.lock:
            if self.unindexed:
                self._insert_many(self.unindexed)
                self.unindexed = []

    def forget(self, size: int) -> None:
        """Writer thread, rolling a failed batch back: drop what it staged or wrote past `size`
        from memory (the records were never entered into the table: see `index`)."""
        self.pending = bytearray()
        self.unindexed.clear()
        self.pack_size = min(self.pack_size, size)
        self.mark = min(self.mark, size)

    def cut(self, size: int) -> None:
        """Cut the pack file back to `size` on a fresh file description, and fsync."""
        os.ftruncate(self.pack, size)
        reopen(self.pack, self.pack_path, os.O_RDWR)
        os.fsync(self.pack)

    def redact(self, digest: bytes, force: bool = False) -> bool:
        """Zero every live copy of this body in place and flag it; fsync. False if none.

        `force` rewrites copies already flagged: after a failed fsync the flag may be in the
        page cache only. The fsync runs outside the lock: a reader waits for the page writes,
        never for the disk.
        """
        done = False
        with self.lock:
            offsets = self._table_offsets(digest) + self.extra.get(digest, [])
            for off in offsets:
                if off + PACK_HEADER.size > self.pack_size:
                    continue
                h, length, flags = PACK_HEADER.unpack(pread_exact(self.pack, PACK_HEADER.size, off))
                if h != digest or (flags & REDACTED and not force):
                    continue
                # Flag first: a reader that sees the zeroed bytes also sees the flag.
                os.pwrite(self.pack, PACK_HEADER.pack(h, length, flags | REDACTED), off)
                pwrite_all(self.pack, bytes(length), off + PACK_HEADER.size)
                done = True
        if done:
            os.fsync(self.pack)
        return done

    def audit(self, limit: int = 20) -> list[str]:
        """Check the table against the pack, up to `mark` (the records the table was synced
        with): every record is found at its offset, every slot points at a record of its body.
        O(records + slots) reads; for deep verify."""
        problems: list[str] = []
        with self.lock:
            end, offset, records = min(self.mark, self.pack_size), 0, 0
            while offset + PACK_HEADER.size <= end and len(problems) < limit:
                digest, length, _ = PACK_HEADER.unpack(
                    pread_exact(self.pack, PACK_HEADER.size, offset)
                )
                if offset not in self._table_offsets(digest) + self.extra.get(digest, []):
                    problems.append(
                        f"bodies.idx: the record of body {digest.hex()} at offset {offset} "
                        "is not in the table"
                    )
                offset += PACK_HEADER.size + length
                records += 1
            table = self.map
            for slot in range(self.slots if table is not None else 0):
                if len(problems) >= limit:
                    break
                assert table is not None
                key, off = _SLOT.unpack_from(table, slot * _SLOT.size)
                if not off:
                    continue
                at = off - 1
                if at >= end:  # past the synced records: a crash may leave stale slots there,
                    continue  # which `locate` skips (it checks the record's header)
                head = os.pread(self.pack, PACK_HEADER.size, at)
                prefix = int.from_bytes(head[:8], "little") or 1
                if len(head) < PACK_HEADER.size or prefix != key:
                    problems.append(
                        f"bodies.idx: slot {slot} points at offset {at}, not a record of its body"
                    )
        return problems

    def rebuild_table(self) -> None:
        """Writer thread: a new table from a scan of the whole pack (after `audit` found it
        wrong). O(records)."""
        with self.lock:
            slots = INITIAL_SLOTS
            while slots < 2 * self.count:
                slots *= 2
            self._new_table(slots)
            offset = 0
            while offset + PACK_HEADER.size <= self.pack_size:
                digest, length, _ = PACK_HEADER.unpack(
                    pread_exact(self.pack, PACK_HEADER.size, offset)
                )
                self._insert(digest, offset)
                offset += PACK_HEADER.size + length
            self.sync_table()

    def sync_pack(self) -> None:
        os.fsync(self.pack)

    def sync_table(self) -> None:
        if self.writable and self.table >= 0:
            if self.map is not None:
                self.map.flush()
            os.fsync(self.table)
        self.mark = self.pack_size

    def close(self) -> None:
        self._unmap()
        for fd in (self.pack, self.table):
            if fd >= 0:
                os.close(fd)
        self.pack = self.table = -1


def body_digest(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


# ---- meta -----------------------------------------------------------------------------------

MARKS = layout.MARKS
_MARK = struct.Struct("<QQ")  # entries, pack bytes: at a derived sync, entries [0, n) had
# all their bodies in pack bytes [0, p). Appended at every sync (derived: a hint for naming
# the first entry whose body a truncated pack lost; see `Ledger._lost_body`).


def add_mark(path: Path, entries: int, pack: int) -> None:
    with contextlib.suppress(OSError):  # a hint: a full disk must not fail the sync for it
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, _MARK.pack(entries, pack))
        finally:
            os.close(fd)


def marks_before(path: Path, pack: int, entries: int) -> int:
    """The largest entry count of a mark whose pack size is at most `pack` (bisection over
    the marks, which grow together); 0 without one. Marks beyond `entries` are ignored."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return 0
    try:
        lo, hi = 0, os.fstat(fd).st_size // _MARK.size
        best = 0
        while lo < hi:
            mid = (lo + hi) // 2
            n, p = _MARK.unpack(pread_exact(fd, _MARK.size, mid * _MARK.size))
            if p <= pack and n <= entries:
                best, lo = max(best, n), mid + 1
            else:
                hi = mid
        return best
    finally:
        os.close(fd)


def read_meta(path: Path) -> dict[str, Any]:
    # derived, checked not trusted: a damaged one (nested past json's limit too) reads as none
    with contextlib.suppress(FileNotFoundError, ValueError, RecursionError):
        data = json.loads(path.read_bytes())
        if isinstance(data, dict):
            return data
    return {}
