"""The ledger: an append-only JSONL log with group commit, recovery, proofs and checkpoints.

One piece (past 500 lines) because every part shares the writer thread's state and its
discipline (the tree, the body store, the file descriptors, the head, the outage): recovery,
commits, rollbacks, proofs and checkpoints each read or change it under the same rules, written
down once below. Self-contained parts live beside it (`store`, `audit`, `outage`, `checkpoint`).

Layout of `<state>/ledger/`: `entries.jsonl` (the record: one canonical entry per line),
`bodies.pack` (content-addressed bodies), derived files (see `store`), `meta.json`,
`checkpoint` (the latest signed note), `checkpoint.key` / `checkpoint.vkey`, `lock`.

Durability invariant. A batch is committed as: pack records written, entry lines written, then
the pack and the entries fsynced concurrently (two sync threads); only once both fsyncs have
returned are the appenders' futures resolved. Both writes precede both fsyncs, and neither
fsync's outcome is acted on alone, so a crash may leave entry lines on disk whose bodies never
reached the pack; such entries were never acknowledged (their batch's fsyncs had not both
returned). Only one batch is ever unacknowledged (the writer commits one at a time) and all of
its entries carry the same `ts`, so recovery drops the tail from the first entry whose body
record is missing only if that tail is one batch (one `ts`, the last line's); a body missing
under an earlier entry was lost after its acknowledgement, and open refuses, naming the seq.
A body that was redacted keeps its (zeroed, flagged) record, so "missing" never means
"redacted".

Write failures (ENOSPC, EDQUOT, EIO: see `outage`). The files hold exactly the acknowledged
prefix, plus at most the one batch being committed. A batch whose write or fsync fails is never
acknowledged and never fsynced again: after a failed fsync the page cache may hold pages the
disk never got, and a second fsync on the same description would report success for them. So
the batch is rolled back (the tree and body table in memory, then the entries and the pack are
truncated to the offsets of the last acknowledged batch on fresh file descriptions, and
fsynced), its appenders get `LedgerUnwritable` (503), and an outage begins: appends fail fast,
a probe retries with backoff (finishing a rollback that failed too), and appends resume when
the disk takes a write + fsync again. A caller that retries writes its entry anew. A failure in
the derived files after both fsyncs returned does not undo the batch (it is durable): it is
acknowledged and the outage begins after it. If the process dies before a failed rollback is
finished, the unacknowledged batch may survive, as it may in any crash.

Derived files are checked, not trusted. Open vouches for the stored tree before anything is
served or signed from it: the root at the latest signed checkpoint must match (else every node
is rebuilt from the leaves, and if it still differs the open is refused), and the nodes past it
are recomputed from the leaves (bounded: RECHECK_MAX). The writer keeps a snapshot of its
frontier (`_head`) after every batch; every proof is checked against the root it implies before
it is served (the leaf re-hashed from the entry line), and a mismatch rebuilds the stored nodes
once (logged) or refuses the proof with `LedgerCorrupt`.

Reads leave the event loop. Every read that touches a file (`get`, `body`, `read_bodies`,
`entries`, `causal_chain`, proofs, `verify`) runs in a worker thread, a batch in one hop;
`read_body` is the blocking form. A body is read back with its state (`Body`), so null,
missing, tampered and redacted are told apart. The body store's lock covers memory and preads
only: the writer grows the table and fsyncs outside it.

Redaction invariant. `redact` makes the `redaction` entry durable first and zeroes the body
second. A crash in between is repaired on open: `meta.json`'s `redact_from` is the lowest seq
of a redaction not yet zeroed when the derived files were last synced (else their size), and
open re-applies every `redaction` entry from there (and from the unindexed tail) on, so a
witnessed redaction always ends with its body gone.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel

from daemon.errors import InvalidInput, NotFound
from daemon.ledger.audit import VerifyReport, gap_reason, verify_files
from daemon.ledger.canonical import NotCanonical, canonical_bytes, canonicalize, check_text
from daemon.ledger.checkpoint import Checkpoint, Signer, load_checkpoint, save_checkpoint
from daemon.ledger.entry import (
    GENESIS_PREV,
    NO_BODY,
    VERSION,
    Body,
    Entry,
    fill_line,
    line_template,
)
from daemon.ledger.errors import LedgerCorrupt, LedgerFailed, LedgerLocked, LedgerUnwritable
from daemon.ledger.merkle import (
    EMPTY_ROOT,
    Frontier,
    consistency_path,
    inclusion_path,
    leaf_hash,
    root_from_inclusion,
    verify_consistency,
)
from daemon.ledger.outage import LedgerHealth, Mark, Outage, probe
from daemon.ledger.store import (
    MARKS,
    BodyStore,
    Tree,
    add_mark,
    body_digest,
    create_dir,
    marks_before,
    open_append,
    read_meta,
    reopen,
    write_all,
    write_atomic,
)

log = logging.getLogger(__name__)

MAX_BATCH = 1024
MAX_BATCH_BYTES = 1 << 20
SYNC_EVERY = 16384  # fsync the derived files at least this often (bounds recovery rescans)
# On open, re-hash only this many indexed entries at the end. Deliberate: open must not re-read
# the history, so a corrupted entry older than that is NOT seen at open (the ledger opens) and
# is found by `verify()`, which re-hashes everything and names its seq.
TAIL_CHECK = 1024
# On open, the stored tree nodes past the latest signed checkpoint are recomputed from the
# leaves (after a clean close there are none; after a crash, about one checkpoint interval's
# worth); at most this many, so open stays bounded (what lies further back is `verify()`'s). A
# ledger never checkpointed (a bench fixture) has no anchor and skips it.
RECHECK_MAX = 1 << 18
READ_CHUNK = 1 << 22
FSYNC_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

_Proof = TypeVar("_Proof", "InclusionProof", "ConsistencyProof")

_set = object.__setattr__
_FIELDS = set(Entry.model_fields)


class InclusionProof(BaseModel):
    leaf_index: int
    tree_size: int
    root: str
    path: list[str]


class ConsistencyProof(BaseModel):
    old_size: int
    new_size: int
    old_root: str
    new_root: str
    path: list[str]


class LedgerStats(BaseModel):
    """Counters for /metrics. `fsync_buckets` are cumulative (Prometheus `le` buckets)."""

    appends: int = 0
    batches: int = 0
    fsync_count: int = 0
    fsync_seconds_sum: float = 0.0
    fsync_buckets: list[tuple[float, int]] = []
    size: int = 0


@dataclass(slots=True)
class _Pending:
    """One queued append, encoded by `append` so the writer only splices in seq, ts, prev."""

    actor: str
    kind: str
    run: str | None
    parent: int | None
    body: bytes | None
    digest: bytes | None
    body_hex: str | None
    head: str
    tail: str
    future: asyncio.Future[Entry]
    redacts: bytes | None = None  # the body this `redaction` entry removes


class _Mismatch(Exception):
    """A proof built from the stored tree did not verify against the trusted root."""


class _Stalled(Exception):
    """Writer thread: a write or fsync failed. `entries`: the batch was durable anyway (only
    the derived files failed after its fsyncs), else it was rolled back."""

    def __init__(self, outage: Outage, entries: list[Entry] | None) -> None:
        super().__init__(outage.detail)
        self.outage = outage
        self.entries = entries


class _Inbox:
    """The appenders' FIFO to the one writer task: a deque and a single wake-up future.

    What `asyncio.Queue` does for this case at a fraction of its per-item cost.
    """

    def __init__(self) -> None:
        self.items: deque[_Pending | None] = deque()
        self._waiter: asyncio.Future[None] | None = None

    def put(self, item: _Pending | None) -> None:
        self.items.append(item)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def wait(self) -> deque[_Pending | None]:
        """Return the (non-empty) deque once something is queued."""
        while not self.items:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        return self.items


@dataclass
class _Stats:
    appends: int = 0
    batches: int = 0
    fsync_count: int = 0
    fsync_sum: float = 0.0
    buckets: list[int] = field(default_factory=lambda: [0] * (len(FSYNC_BUCKETS) + 1))

    def observe(self, seconds: float) -> None:
        self.fsync_count += 1
        self.fsync_sum += seconds
        self.buckets[bisect.bisect_left(FSYNC_BUCKETS, seconds)] += 1


def check_append(
    *, actor: str, kind: str, body: Any, run: str | None, parent: int | None, size: int
) -> bytes | None:
    """What `Ledger.append` accepts, as one function (the engine's in-memory test ledger calls
    it too, so both refuse the same inputs): non-empty ASCII-or-UTF-8 actor and kind, a run
    id or None, a parent that is an existing seq, a body in the canonical JSON subset (no
    floats, integers within ±2^53, no lone surrogates). Returns the body's canonical bytes."""
    if not isinstance(actor, str) or not actor or not isinstance(kind, str) or not kind:
        raise InvalidInput("actor and kind must be non-empty strings")
    if run is not None and not isinstance(run, str):
        raise InvalidInput("run must be a string or None")
    if parent is not None and (
        not isinstance(parent, int) or isinstance(parent, bool) or not 0 <= parent < size
    ):
        raise InvalidInput(f"parent {parent!r} is not an existing seq")
    try:
        for text in (actor, kind, run):
            if text is not None and not text.isascii():  # ASCII is always UTF-8 safe
                check_text(text)
        return None if body is None else canonicalize(body)
    except NotCanonical as err:
        raise InvalidInput(f"not storable in the ledger: {err}") from err


class Ledger:
    """Open with `await Ledger.open(state_dir)`; see the module doc for the on-disk contract."""

    def __init__(self, state_dir: Path, readonly: bool, tail_check: int = TAIL_CHECK) -> None:
        self.state_dir = state_dir
        self._tail_check = tail_check
        self.dir = state_dir / "ledger"
        self.readonly = readonly
        self._lock_fd = -1
        self._entries_fd = -1
        self._entries_end = 0
        self._size = 0  # committed and acknowledged-visible
        self._last_hash = GENESIS_PREV
        self._last_ts = 0
        self._synced = 0
        self._failed: LedgerFailed | None = None  # a bug mid-commit: nothing safe to resume
        self._outage: Outage | None = None  # the disk refused a write: probing for its return
        self._prober: asyncio.Task[None] | None = None
        self._write_failures = 0
        self._closed = False
        self._stats = _Stats()
        self._latest: Checkpoint | None = None
        self._signer: Signer | None = None
        self._vkey: str | None = None
        self._queue = _Inbox()
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ledger-writer")
        self._syncer = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ledger-sync")
        self._unapplied: dict[int, bytes] = {}  # redaction seq -> body not yet zeroed
        # The writer's frontier after its last batch (vouched for at open): proofs are checked
        # against the root it implies. A snapshot, swapped whole, so readers never see a torn one.
        self._head: tuple[int, tuple[tuple[int, bytes], ...]] = (0, ())
        self._repaired = False  # the stored tree is rebuilt at most once per open
        self._writer: asyncio.Task[None] | None = None
        self._ticker: asyncio.Task[None] | None = None
        self.tree: Tree
        self.bodies: BodyStore

    # ---- open / recovery ------------------------------------------------------------------

    @classmethod
    async def open(
        cls,
        state_dir: Path | str,
        readonly: bool = False,
        *,
        checkpoint_interval: float | None = 60.0,
        tail_check: int = TAIL_CHECK,
    ) -> Ledger:
        """Recover and (unless read-only) lock.

        `tail_check`: how many of the last indexed entries are re-hashed against their leaf
        hashes. Corruption further back is not detected here (open must not re-read the
        history; see TAIL_CHECK): `verify()` finds it.
        """
        ledger = cls(Path(state_dir), readonly, tail_check)
        try:
            await asyncio.get_running_loop().run_in_executor(ledger._executor, ledger._open)
        except BaseException:
            ledger._release()
            raise
        if not readonly:
            ledger._writer = asyncio.create_task(ledger._write_loop(), name="ledger-writer")
            if checkpoint_interval:
                ledger._ticker = asyncio.create_task(
                    ledger._tick(checkpoint_interval), name="ledger-checkpoints"
                )
        return ledger

    def _open(self) -> None:
        if self.readonly:
            if not self.dir.is_dir():
                raise NotFound(f"no ledger in {self.state_dir}")
        else:
            create_dir(self.dir)
            self._take_lock()
        meta = read_meta(self.dir / "meta.json")
        trusted = int(meta.get("size", 0))
        self.tree = Tree(self.dir, not self.readonly, trusted)
        entries_path = self.dir / "entries.jsonl"
        if self.readonly:
            self._entries_fd = (
                os.open(entries_path, os.O_RDONLY | os.O_CLOEXEC) if entries_path.exists() else -1
            )
        else:
            self._entries_fd = open_append(entries_path)
        self.bodies = BodyStore(
            self.dir, not self.readonly, int(meta.get("pack", 0)), int(meta.get("bodies", 0))
        )
        if self.bodies.lost:
            raise LedgerCorrupt(*self._lost_body())
        indexed = self.tree.size
        self._recover()
        if not self.readonly:
            self._reapply_redactions(min(int(meta.get("redact_from", indexed)), indexed))
        self._size = self.tree.size
        self._synced = min(trusted, self._size)
        if self._size:
            self._last_hash = self.tree.leaf(self._size - 1).hex()
            self._last_ts = self._read_entry(self._size - 1).ts
        if self.readonly:
            vkey_path = self.dir / "checkpoint.vkey"
            self._vkey = vkey_path.read_text().strip() if vkey_path.exists() else None
        else:
            self._signer = Signer.load_or_create(self.dir, writable=True)
            self._vkey = self._signer.vkey if self._signer is not None else None
        self._latest = load_checkpoint(self.dir / "checkpoint")
        self._anchor(self._latest)

    def _anchor(self, latest: Checkpoint | None) -> None:
        """Vouch for the stored tree (module doc: derived files are checked, not trusted)."""
        tree, size = self.tree, self.tree.size
        signed = 0 if latest is None else latest.size
        if signed > size:
            raise LedgerCorrupt(size, f"checkpoint covers {signed} entries, only {size} remain")
        if latest is not None and tree.root(signed).hex() != latest.root:
            fixed, frontier = tree.recheck(0)
            tree.frontier = frontier
            if tree.root(signed).hex() != latest.root:
                raise LedgerCorrupt(
                    signed - 1,
                    "tree differs from the latest checkpoint even rebuilt from the leaf hashes "
                    "(`tally ledger verify` names the entry)",
                )
        elif latest is not None:  # unsigned ledgers (bench fixtures) have nothing to anchor to
            fixed, tree.frontier = tree.recheck(max(signed, size - RECHECK_MAX))
        else:
            fixed = []
        if fixed:
            level, index = fixed[0]
            log.warning(
                "ledger: %d stored tree nodes did not match the leaves (first: level %d node %d); "
                "rebuilt%s",
                len(fixed),
                level,
                index,
                "" if tree.writable else " in memory (read-only)",
            )
        self._head = tree.frontier.snapshot()

    def _take_lock(self) -> None:
        path = self.dir / "lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            os.close(fd)
            pid = int(holder) if holder.isdigit() else None
            raise LedgerLocked(str(self.state_dir), pid) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    def _file_size(self) -> int:
        return os.fstat(self._entries_fd).st_size if self._entries_fd >= 0 else 0

    def _recover(self) -> None:
        """Check the indexed tail, then extend the index over the unindexed entries.

        Only the last `tail_check` indexed entries are re-hashed (see TAIL_CHECK).
        """
        tree = self.tree
        n = tree.size
        file_size = self._file_size()
        if n and tree.end(n - 1) > file_size:
            raise LedgerCorrupt(*self._first_broken(n))
        first = max(0, n - self._tail_check)
        if n > first:
            start, end = tree.end(first - 1), tree.end(n - 1)
            lines = os.pread(self._entries_fd, end - start, start).split(b"\n")[:-1]
            for i, line in enumerate(lines):
                if leaf_hash(line) != tree.leaf(first + i):
                    raise LedgerCorrupt(*self._first_broken(first + i + 1))
        offset = tree.end(n - 1)
        prev = tree.leaf(n - 1).hex() if n else GENESIS_PREV
        buf = b""
        while True:
            chunk = os.pread(self._entries_fd, READ_CHUNK, offset + len(buf))
            if not chunk:
                break
            buf += chunk
            lines = buf.split(b"\n")
            buf = lines.pop()
            for line in lines:
                problem, missing_body = self._check_line(line, tree.size, prev)
                if problem is not None:
                    line_end = offset + len(line) + 1
                    rest = file_size - line_end
                    if missing_body and not self._one_batch(offset):
                        raise LedgerCorrupt(
                            tree.size,
                            "its body is missing from bodies.pack, and entries of a later batch "
                            "follow it: it was acknowledged, and the pack lost its body",
                        )
                    if missing_body or rest == 0 or _only_junk(self._entries_fd, line_end):
                        self._truncate_entries(offset)
                        return
                    raise LedgerCorrupt(tree.size, problem)
                digest = leaf_hash(line)
                offset += len(line) + 1
                tree.append(digest, offset)
                prev = digest.hex()
            tree.flush()
        if buf:  # a torn last line
            self._truncate_entries(offset)
        tree.flush()

    def _first_broken(self, n: int) -> tuple[int, str]:
        """The first of the first `n` indexed entries whose line is not where the index puts
        it (lines deleted, inserted or changed), and why: a bisection, O(log n) reads. The
        entries before it are intact, so open and `verify` name the same seq."""
        tree, fd, file_size = self.tree, self._entries_fd, self._file_size()

        def intact(i: int) -> bool:
            start, end = tree.span(i)
            if end > file_size:
                return False
            data = os.pread(fd, end - start, start)
            return data.endswith(b"\n") and leaf_hash(data[:-1]) == tree.leaf(i)

        lo, hi = 0, n - 1  # the last one is known to be broken
        while lo < hi:
            mid = (lo + hi) // 2
            if intact(mid):
                lo = mid + 1
            else:
                hi = mid
        start = tree.end(lo - 1)
        if start >= file_size:
            return lo, f"entries from seq {lo} on are missing: the entries file ends there"
        line = os.pread(fd, 1 << 16, start).split(b"\n")[0]
        return lo, gap_reason(line, lo) or "entry bytes do not match the recorded leaf hash"

    def _one_batch(self, offset: int) -> bool:
        """True if the complete lines from `offset` on can be one batch (at most MAX_BATCH, all
        with the first one's `ts`): the only tail a crash can leave unacknowledged."""
        ts: bytes | None = None
        count, buf, at = 0, b"", offset
        while True:
            chunk = os.pread(self._entries_fd, READ_CHUNK, at)
            if not chunk:
                return True
            at += len(chunk)
            lines = (buf + chunk).split(b"\n")
            buf = lines.pop()
            for line in lines:
                count += 1
                stamp = _ts(line)
                ts = stamp if ts is None else ts
                if count > MAX_BATCH or stamp != ts:
                    return False

    def _lost_body(self) -> tuple[int, str]:
        """bodies.pack is shorter than when the derived files were last synced: name the first
        indexed entry whose body is gone. The scan starts at the last sync mark the pack still
        covers (`marks.bin`), so it reads about one sync interval of entries."""
        tree, bodies = self.tree, self.bodies
        seq = marks_before(self.dir / MARKS, bodies.pack_size, tree.size)
        gone = f"bodies.pack ends at byte {bodies.pack_size}, it held {bodies.mark} when synced"
        while seq < tree.size:
            stop = min(tree.size, seq + 4096)
            a, b = tree.end(seq - 1), tree.end(stop - 1)
            for line in os.pread(self._entries_fd, b - a, a).split(b"\n")[:-1]:
                at = line.find(b'"body":"')
                digest = _hex(line[at + 8 : at + 72]) if at >= 0 else None
                if digest is not None and bodies.locate(digest) is None:
                    return seq, f"its body is gone: {gone} (truncated?)"
                seq += 1
        return tree.size, f"acknowledged bodies are gone: {gone} (truncated?)"

    def _check_line(self, line: bytes, seq: int, prev: str) -> tuple[str | None, bool]:
        try:
            entry = Entry.from_line(line)
        except ValueError as err:
            return f"entry does not parse: {err}", False
        if entry.seq != seq:
            return f"expected seq {seq}, found {entry.seq}", False
        if entry.prev != prev:
            return "prev does not link to the previous entry", False
        if entry.body is not None and self.bodies.locate(bytes.fromhex(entry.body)) is None:
            return "body missing from the pack (unacknowledged tail)", True
        return None, False

    def _truncate_entries(self, offset: int) -> None:
        if self.readonly:
            return
        log.warning("ledger: dropping a torn tail of %d bytes", self._file_size() - offset)
        os.ftruncate(self._entries_fd, offset)
        os.fsync(self._entries_fd)

    # ---- appending ------------------------------------------------------------------------

    @property
    def size(self) -> int:
        return self._size

    async def append(
        self,
        *,
        actor: str,
        kind: str,
        body: Any = None,
        run: str | None = None,
        parent: int | None = None,
    ) -> Entry:
        """Append one entry; returns once it (and its body) are fsynced."""
        if self._failed is not None:
            raise self._failed
        if self._outage is not None:
            raise self._outage.error()
        if self.readonly or self._closed:
            raise LedgerFailed("the ledger is closed or read-only")
        data = check_append(
            actor=actor, kind=kind, body=body, run=run, parent=parent, size=self._size
        )
        return await self._enqueue(actor, kind, run, parent, data, None)

    def _enqueue(
        self,
        actor: str,
        kind: str,
        run: str | None,
        parent: int | None,
        data: bytes | None,
        redacts: bytes | None,
    ) -> asyncio.Future[Entry]:
        """Queue checked fields; the encoding and body hash happen here, off the writer."""
        future: asyncio.Future[Entry] = asyncio.get_running_loop().create_future()
        digest = None if data is None else body_digest(data)
        body_hex = None if digest is None else digest.hex()
        head, tail = line_template(actor=actor, kind=kind, run=run, parent=parent, body=body_hex)
        self._queue.put(
            _Pending(actor, kind, run, parent, data, digest, body_hex, head, tail, future, redacts)
        )
        # A cancelled caller cancels only its wait: the writer skips done futures and still
        # commits the entry, so nothing acknowledged is ever undone.
        return future

    async def _write_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            items = await self._queue.wait()
            first = items.popleft()
            if first is None:
                return
            batch, size, stop = [first], len(first.body or b""), False
            while len(batch) < MAX_BATCH and size < MAX_BATCH_BYTES and items:
                item = items.popleft()
                if item is None:
                    stop = True
                    break
                batch.append(item)
                size += len(item.body or b"")
            if self._outage is not None:  # queued before the outage began
                self._refuse(batch, self._outage.error())
                if stop:
                    return
                continue
            try:
                entries = await loop.run_in_executor(self._executor, self._commit, batch)
            except _Stalled as stall:
                self._begin_outage(stall.outage)
                if stall.entries is None:
                    self._refuse(batch, stall.outage.error())
                    if stop:
                        return
                    continue
                entries = stall.entries
            except Exception as err:
                self._fail(err, batch)
                return
            self._size += len(entries)
            for pending, entry in zip(batch, entries, strict=True):
                if not pending.future.done():
                    pending.future.set_result(entry)
            if stop:
                return

    def _commit(self, batch: list[_Pending]) -> list[Entry]:
        """Writer thread: commit a batch, or roll it back and raise `_Stalled` (module doc)."""
        mark = Mark(self.tree.size, self._entries_end_offset(), self.bodies.pack_size)
        try:
            entries = self._write_batch(batch)
        except OSError as err:
            self._write_failures += 1
            log.error("ledger: a write or fsync failed (%s): rolling the batch back", err)
            raise _Stalled(Outage.of(err, self._rollback(mark)), None) from err
        if self.tree.size - self._synced >= SYNC_EVERY:
            try:
                self._sync_derived()
            except OSError as err:
                self._write_failures += 1
                raise _Stalled(Outage.of(err), entries) from err
        return entries

    def _write_batch(self, batch: list[_Pending]) -> list[Entry]:
        """Writer thread: encode, write pack + entries, fsync both at once, extend the tree."""
        tree, bodies = self.tree, self.bodies
        seq, prev, end = tree.size, self._last_hash, self._entries_end_offset()
        ts = max(time.time_ns() // 1000, self._last_ts)
        lines: list[bytes] = []
        leaves: list[bytes] = []
        staged: set[bytes] = set()
        for p in batch:
            digest = p.digest
            if digest is not None and digest not in staged:
                staged.add(digest)
                if not bodies.has_live(digest):
                    assert p.body is not None
                    bodies.stage(digest, p.body)
        bodies.reserve(len(staged))
        t0 = time.perf_counter()
        # The pack is written (and its fsync started) before the entries are even encoded;
        # the entries' fsync follows their write; this thread then does the rest of the
        # batch's CPU work while both run. The batch is acknowledged only after both fsyncs
        # returned (see the module doc).
        syncs = []
        failure: BaseException | None = None
        try:
            if bodies.pending:
                bodies.write()
                syncs.append(self._syncer.submit(bodies.sync_pack))
            sha256 = hashlib.sha256
            for p in batch:
                line = fill_line(p.head, p.tail, seq, ts, prev)
                leaf = sha256(b"\x00" + line).digest()
                lines.append(line)
                leaves.append(leaf)
                prev = leaf.hex()
                seq += 1
            lines.append(b"")
            write_all(self._entries_fd, b"\n".join(lines))
            syncs.append(self._syncer.submit(os.fsync, self._entries_fd))
            entries = self._extend(batch, lines, leaves, end, ts)
        except BaseException as err:
            failure = err
        # Every started fsync is waited for, even after a failure: the rollback must not race
        # a sync thread still writing the batch.
        for sync in syncs:
            try:
                sync.result()
            except OSError as err:
                failure = failure or err
        if failure is not None:
            raise failure
        bodies.index()  # only now: a rolled-back batch never leaves a slot in the table
        self._head = tree.frontier.snapshot()
        self._stats.observe(time.perf_counter() - t0)
        self._stats.appends += len(batch)
        self._stats.batches += 1
        self._last_hash, self._last_ts = prev, ts
        return entries

    def _rollback(self, mark: Mark) -> Mark | None:
        """Writer thread: undo a failed batch. Returns `mark` if the files could not be cut
        back yet (the probe finishes it); memory is rolled back in any case."""
        self.tree.truncate(mark.size, Frontier.restore(self._head))
        self.bodies.forget(mark.pack_size)
        self._entries_end = mark.entries_end
        for seq in [s for s in self._unapplied if s >= mark.size]:
            del self._unapplied[seq]
        try:
            self._cut(mark)
        except OSError as err:
            log.error("ledger: the rollback failed too (%s); the probe retries it", err)
            return mark
        return None

    def _cut(self, mark: Mark) -> None:
        """Writer thread: truncate the record files to `mark` on fresh descriptions, fsynced."""
        os.ftruncate(self._entries_fd, mark.entries_end)
        reopen(self._entries_fd, self.dir / "entries.jsonl", os.O_RDWR | os.O_APPEND)
        os.fsync(self._entries_fd)
        self.bodies.cut(mark.pack_size)

    def _refuse(self, batch: list[_Pending], error: LedgerUnwritable) -> None:
        for pending in batch:
            if not pending.future.done():
                pending.future.set_exception(error)

    def _begin_outage(self, outage: Outage) -> None:
        """Loop thread: stop accepting writes and start probing for the disk's return."""
        current = self._outage
        if current is not None:
            current.rollback = current.rollback or outage.rollback
            return
        self._outage = outage
        log.error(
            "ledger: cannot write (%s): appends fail with 503 until the disk takes writes again",
            outage.detail,
        )
        if not self._closed:
            self._prober = asyncio.create_task(self._probe_loop(), name="ledger-probe")

    async def _probe_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while (outage := self._outage) is not None:
            await asyncio.sleep(outage.delay)
            try:
                await loop.run_in_executor(self._executor, self._probe, outage)
            except OSError as err:
                self._write_failures += 1
                outage.again(err)
                log.warning("ledger: still cannot write (%s); retrying", outage.detail)
                continue
            log.warning(
                "ledger: writable again after %.1f s; appends resume",
                time.monotonic() - outage.since,
            )
            self._outage = None

    def _probe(self, outage: Outage) -> None:
        """Writer thread: finish the rollback, write + fsync a scratch file, re-zero redactions
        whose zeroing failed, sync the derived files. Raises OSError while the disk refuses."""
        if outage.rollback is not None:
            self._cut(outage.rollback)
            outage.rollback = None
        probe(self.dir)
        for seq, digest in sorted(self._unapplied.items()):
            self.bodies.redact(digest, force=True)
            self._unapplied.pop(seq, None)
        self._sync_derived()

    @property
    def health(self) -> LedgerHealth:
        """Whether the ledger can write right now, and if not, why (health, /healthz, /metrics)."""
        if self._failed is not None:
            return LedgerHealth(
                writable=False,
                reason="failed",
                detail=self._failed.message,
                write_failures=self._write_failures,
            )
        outage = self._outage
        if outage is None:
            return LedgerHealth(writable=True, write_failures=self._write_failures)
        return LedgerHealth(
            writable=False,
            reason=outage.reason,
            detail=outage.detail,
            since_s=round(time.monotonic() - outage.since, 3),
            write_failures=self._write_failures,
        )

    def _extend(
        self, batch: list[_Pending], lines: list[bytes], leaves: list[bytes], end: int, ts: int
    ) -> list[Entry]:
        """Writer thread, during the fsyncs: grow the tree, build entries."""
        tree = self.tree
        new_entry = Entry.__new__
        seq, prev = tree.size, self._last_hash
        entries: list[Entry] = []
        ends: list[int] = []
        for p, line, leaf in zip(batch, lines, leaves, strict=False):
            end += len(line) + 1
            ends.append(end)
            leaf_hex = leaf.hex()
            # What `model_construct` does, minus its per-field work: every field is checked.
            entry = new_entry(Entry)
            _set(
                entry,
                "__dict__",
                {
                    "v": VERSION,
                    "seq": seq,
                    "ts": ts,
                    "actor": p.actor,
                    "kind": p.kind,
                    "run": p.run,
                    "parent": p.parent,
                    "body": p.body_hex,
                    "prev": prev,
                    "hash": leaf_hex,
                },
            )
            _set(entry, "__pydantic_fields_set__", _FIELDS.copy())
            _set(entry, "__pydantic_extra__", None)
            _set(entry, "__pydantic_private__", None)
            entries.append(entry)
            if p.redacts is not None:
                self._unapplied[seq] = p.redacts
            prev = leaf_hex
            seq += 1
        tree.extend(leaves, ends)
        self._entries_end = end
        tree.flush(force=False)
        return entries

    def _entries_end_offset(self) -> int:
        if self._entries_end == 0 and self.tree.size:
            self._entries_end = self.tree.end(self.tree.size - 1)
        return self._entries_end

    def _sync_derived(self) -> None:
        """Writer thread: fsync the derived files and record how far they can be trusted."""
        if self._failed is not None:
            raise self._failed
        self.tree.sync()
        self.bodies.sync_table()
        meta = {
            "size": self.tree.size,
            "pack": self.bodies.mark,
            "bodies": self.bodies.count,
            "redact_from": min(self._unapplied, default=self.tree.size),
        }
        write_atomic(self.dir / "meta.json", json.dumps(meta).encode())
        self._synced = self.tree.size
        add_mark(self.dir / MARKS, self.tree.size, self.bodies.mark)

    def _fail(self, err: BaseException, batch: list[_Pending]) -> None:
        log.critical("ledger: write or fsync failed, refusing further appends: %s", err)
        self._failed = LedgerFailed(f"ledger write failed: {err}")
        while self._queue.items:
            item = self._queue.items.popleft()
            if item is not None:
                batch.append(item)
        for pending in batch:
            if not pending.future.done():
                pending.future.set_exception(self._failed)

    # ---- redaction ------------------------------------------------------------------------

    async def redact(self, body_hash: str, *, actor: str, reason: str) -> Entry:
        """Witness the removal with a `redaction` entry, then zero the body in place.

        A crash (or a cancelled caller) between the two steps leaves a witnessed redaction
        whose body is still there: the writer keeps the entry's seq in `_unapplied` until the
        body is zeroed, `meta.json` records the lowest such seq (`redact_from`), and open
        re-applies every redaction from there on (see `_reapply_redactions`).
        """
        try:
            digest = bytes.fromhex(body_hash)
        except ValueError as err:
            raise InvalidInput(f"not a body hash: {body_hash!r}") from err
        if self._failed is not None:
            raise self._failed
        if self._outage is not None:
            raise self._outage.error()
        if self.readonly or self._closed:
            raise LedgerFailed("the ledger is closed or read-only")
        if not isinstance(actor, str) or not actor:
            raise InvalidInput("actor must be a non-empty string")
        if self.bodies.locate(digest) is None:
            raise NotFound(f"no body {body_hash}")
        try:
            check_text(actor)
            data = canonicalize({"redacted": body_hash, "reason": reason})
        except NotCanonical as err:
            raise InvalidInput(f"not storable in the ledger: {err}") from err
        entry = await self._enqueue(actor, "redaction", None, None, data, digest)
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self._executor, self._apply_redaction, entry.seq, digest)
        except OSError as err:
            self._write_failures += 1
            outage = Outage.of(err)
            self._begin_outage(outage)  # the probe zeroes it again (and open re-applies it)
            raise LedgerUnwritable(
                outage.reason,
                outage.detail,
                outage.delay,
                what=f"the redaction is witnessed (seq {entry.seq}) but the body is not zeroed "
                "yet; it will be once the disk takes writes again",
            ) from err
        return entry

    def _apply_redaction(self, seq: int, digest: bytes) -> None:
        """Writer thread: zero the body (fsynced), then forget the pending redaction."""
        self.bodies.redact(digest)
        self._unapplied.pop(seq, None)

    def _reapply_redactions(self, start: int) -> None:
        """Open: zero the bodies named by `redaction` entries from `start` on (idempotent)."""
        size = self.tree.size
        seq = start
        while seq < size:
            stop = min(size, seq + 4096)
            a, b = self.tree.end(seq - 1), self.tree.end(stop - 1)
            for line in os.pread(self._entries_fd, b - a, a).split(b"\n")[:-1]:
                if b'"kind":"redaction"' not in line:
                    continue
                target = self._redaction_target(Entry.from_line(line))
                if target is not None and self.bodies.redact(target):
                    log.warning("ledger: re-applied the redaction of body %s", target.hex())
            seq = stop

    def _redaction_target(self, entry: Entry) -> bytes | None:
        if entry.kind != "redaction" or entry.body is None:
            return None
        data, _ = self.bodies.read(bytes.fromhex(entry.body))
        try:
            value = json.loads(data) if data is not None else None
            target = value.get("redacted") if isinstance(value, dict) else None
            return bytes.fromhex(target) if isinstance(target, str) else None
        except ValueError:
            return None

    # ---- reading --------------------------------------------------------------------------

    def _read_entry(self, seq: int) -> Entry:
        start, end = self.tree.span(seq)
        return Entry.from_line(os.pread(self._entries_fd, end - start - 1, start))

    async def get(self, seq: int) -> Entry:
        if not 0 <= seq < self._size:
            raise NotFound(f"no ledger entry {seq} (size {self._size})")
        return await asyncio.to_thread(self._read_entry, seq)

    def read_body(self, body_hash: str | None) -> Body:
        """The body with its state (see `Body`). Blocking: a pread, a SHA-256 and a JSON
        parse; on the event loop use `body` or `read_bodies`, which run it in a thread."""
        if body_hash is None:
            return NO_BODY
        try:
            digest = bytes.fromhex(body_hash)
        except ValueError:
            return Body("missing")
        data, redacted = self.bodies.read(digest)
        if redacted:
            return Body("redacted")
        if data is None:
            return Body("missing")
        if body_digest(data) != digest:
            return Body("tampered")
        return Body("present", json.loads(data))

    async def body(self, body_hash: str | None) -> Body:
        """One body with its state, read in a worker thread."""
        return await asyncio.to_thread(self.read_body, body_hash)

    async def read_bodies(self, hashes: Sequence[str | None]) -> list[Body]:
        """Many bodies in one worker-thread hop, in order (a batch of entries' bodies)."""
        if not any(hashes):
            return [NO_BODY] * len(hashes)
        return await asyncio.to_thread(lambda: [self.read_body(h) for h in hashes])

    async def entries(
        self,
        start: int = 0,
        limit: int = 100,
        kind: str | None = None,
        run: str | None = None,
        actor: str | None = None,
        in_run: bool = False,
    ) -> list[Entry]:
        """Entries with seq >= start matching all given filters, at most `limit` of them.

        `in_run` keeps only entries that belong to some run, so rebuilding run state skips
        the (possibly millions of) entries that belong to none without parsing them.
        """
        size = self._size
        if limit <= 0 or start >= size:
            return []
        needles = [
            f'"{key}":'.encode() + canonical_bytes(value) + b","
            for key, value in (("kind", kind), ("run", run), ("actor", actor))
            if value is not None
        ]
        shunned = [b'"run":null,'] if in_run else []
        return await asyncio.to_thread(self._scan, max(start, 0), size, limit, needles, shunned)

    def _scan(
        self, start: int, size: int, limit: int, needles: list[bytes], shunned: list[bytes]
    ) -> list[Entry]:
        found: list[Entry] = []
        seq = start
        while seq < size and len(found) < limit:
            stop = min(size, seq + 4096)
            a, b = self.tree.end(seq - 1), self.tree.end(stop - 1)
            lines = os.pread(self._entries_fd, b - a, a).split(b"\n")[:-1]
            for line in lines:
                if all(n in line for n in needles) and not any(n in line for n in shunned):
                    found.append(Entry.from_line(line))
                    if len(found) == limit:
                        break
            seq = stop
        return found

    async def causal_chain(self, seq: int) -> list[Entry]:
        """The entry and its ancestors through `parent`, root first (one thread hop)."""
        if not 0 <= seq < self._size:
            raise NotFound(f"no ledger entry {seq} (size {self._size})")
        return await asyncio.to_thread(self._chain, seq)

    def _chain(self, seq: int) -> list[Entry]:
        chain = [self._read_entry(seq)]
        while chain[-1].parent is not None:
            chain.append(self._read_entry(chain[-1].parent))
        chain.reverse()
        return chain

    async def verify(self, deep: bool = False) -> VerifyReport:
        size = self._size
        latest = self._latest
        pinned = None
        if latest is not None and latest.size <= size:
            pinned = (latest.size, bytes.fromhex(latest.root))
        report = await asyncio.to_thread(
            verify_files, self.dir / "entries.jsonl", self.tree, self.bodies, size, deep, pinned
        )
        if report.derived and not self.readonly and self._failed is None:
            loop = asyncio.get_running_loop()
            rebuilt = await loop.run_in_executor(self._executor, self._rebuild, report.derived)
            log.warning(
                "ledger: verify found derived files that do not match the entries (%s); "
                "rebuilt: %s",
                report.derived[0],
                ", ".join(rebuilt) or "nothing (see the report)",
            )
            report = report.model_copy(update={"rebuilt": rebuilt})
        return report

    def _rebuild(self, problems: list[str]) -> list[str]:
        """Writer thread: rebuild the caches `verify` found wrong (the tree nodes and the body
        table; wrong offsets in index.bin are reported only: see the README)."""
        rebuilt = []
        if any(p.startswith("tree/") for p in problems) and self._rebuild_tree():
            rebuilt.append("tree/level-*.bin")
        if any(p.startswith("bodies.idx") for p in problems):
            self.bodies.rebuild_table()
            rebuilt.append("bodies.idx")
        return rebuilt

    def root(self, size: int | None = None) -> str:
        """The stored tree's root at `size` (proofs use `_trusted_root`, which checks it)."""
        size = self._size if size is None else size
        if not 0 <= size <= self._size:
            raise NotFound(f"tree size {size} is beyond the ledger's size {self._size}")
        return self.tree.subtree(0, size).hex() if size else self.tree.root(0).hex()

    def leaf_hash(self, seq: int) -> str:
        return self.tree.leaf(seq).hex()

    async def inclusion_proof(self, seq: int, size: int | None = None) -> InclusionProof:
        """An RFC 9162 inclusion proof, checked against the writer's root before it is served."""
        size = self._size if size is None else size
        if not 0 <= seq < size <= self._size:
            raise NotFound(f"no inclusion proof for seq {seq} in a tree of size {size}")
        return await self._checked(lambda: self._inclusion(seq, size), seq)

    async def consistency_proof(self, old: int, new: int | None = None) -> ConsistencyProof:
        """An RFC 9162 consistency proof, checked like `inclusion_proof`."""
        new = self._size if new is None else new
        if not 0 <= old <= new <= self._size:
            raise NotFound(f"no consistency proof from size {old} to {new}")
        return await self._checked(lambda: self._consistency(old, new), max(old - 1, 0))

    def _inclusion(self, seq: int, size: int) -> InclusionProof:
        path = inclusion_path(seq, size, self.tree.subtree)
        root = self._trusted_root(size)
        start, end = self.tree.span(seq)
        leaf = leaf_hash(os.pread(self._entries_fd, end - start - 1, start))  # the record's
        if root_from_inclusion(seq, size, leaf, path) != root:
            raise _Mismatch(f"an inclusion proof of seq {seq} in {size} did not verify")
        return InclusionProof(
            leaf_index=seq, tree_size=size, root=root.hex(), path=[p.hex() for p in path]
        )

    def _consistency(self, old: int, new: int) -> ConsistencyProof:
        path = consistency_path(old, new, self.tree.subtree)
        new_root = self._trusted_root(new)
        old_root = self.tree.subtree(0, old) if old else EMPTY_ROOT
        if not verify_consistency(old, new, old_root, new_root, path):
            raise _Mismatch(f"a consistency proof from {old} to {new} did not verify")
        return ConsistencyProof(
            old_size=old,
            new_size=new,
            old_root=old_root.hex(),
            new_root=new_root.hex(),
            path=[p.hex() for p in path],
        )

    def _trusted_root(self, size: int) -> bytes:
        """The root at `size`, vouched for by the writer's frontier (`_head`): read from the
        stored nodes, then proven consistent with the head's root. Raises `_Mismatch`."""
        head = self._head
        head_root = Frontier.restore(head).root()
        if size == head[0]:
            return head_root
        root = self.tree.subtree(0, size) if size else EMPTY_ROOT
        path = consistency_path(size, head[0], self.tree.subtree)
        if not verify_consistency(size, head[0], root, head_root, path):
            raise _Mismatch(f"the stored root at size {size} is not consistent with the head")
        return root

    async def _checked(self, build: Callable[[], _Proof], seq: int) -> _Proof:
        """Serve `build()`'s proof if it checks; else rebuild the stored tree once and retry;
        else refuse (a wrong proof is never served). Built in a worker thread: O(log n) preads
        and hashes, each of which may wait for the disk."""
        try:
            return await asyncio.to_thread(build)
        except _Mismatch as first:
            await self._repair(str(first))
            try:
                return await asyncio.to_thread(build)
            except _Mismatch as again:
                raise LedgerCorrupt(
                    seq,
                    f"{again}: the stored tree or index does not match the entries; the proof "
                    "is refused (`tally ledger verify` says where)",
                ) from None

    async def _repair(self, why: str) -> None:
        """Rebuild the stored tree nodes from the leaf hashes, once per open, on the writer's
        thread (so no batch runs meanwhile); the head is kept whatever the rebuild finds."""
        if self._repaired:
            return
        self._repaired = True
        loop = asyncio.get_running_loop()
        fixed = await loop.run_in_executor(self._executor, self._rebuild_tree)
        log.warning("ledger: %s; rebuilt %d stored tree nodes from the leaf hashes", why, fixed)

    def _rebuild_tree(self) -> int:
        fixed, frontier = self.tree.recheck(0)
        if frontier.snapshot() != self._head:
            log.error("ledger: the leaf hashes do not add up to the head: see `ledger verify`")
        return len(fixed)

    # ---- checkpoints ----------------------------------------------------------------------

    @property
    def vkey(self) -> str | None:
        """The checkpoint verifier key (C2SP vkey string), if the ledger has one."""
        return self._vkey

    def latest_checkpoint(self) -> Checkpoint | None:
        return self._latest

    async def checkpoint(self) -> Checkpoint:
        """Sign and persist a checkpoint of everything committed so far."""
        if self.readonly or self._signer is None:
            raise LedgerFailed("checkpoints are written by the ledger's owner only")
        if self._failed is not None:
            raise self._failed
        if self._outage is not None:
            raise self._outage.error(what="no checkpoint was written")
        loop = asyncio.get_running_loop()
        try:
            checkpoint = await loop.run_in_executor(self._executor, self._checkpoint)
        except OSError as err:
            self._write_failures += 1
            outage = Outage.of(err)
            self._begin_outage(outage)
            raise outage.error(what="no checkpoint was written") from err
        self._latest = checkpoint
        return checkpoint

    def _checkpoint(self) -> Checkpoint:
        assert self._signer is not None
        if self._failed is not None:
            raise self._failed
        self._sync_derived()
        checkpoint = self._signer.sign(
            self.tree.size, self.tree.root(), max(time.time_ns() // 1000, self._last_ts)
        )
        save_checkpoint(self.dir / "checkpoint", checkpoint)
        return checkpoint

    async def _tick(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            latest = self._latest
            healthy = self._failed is None and self._outage is None
            if healthy and (latest is None or latest.size != self._size):
                try:
                    await self.checkpoint()
                except LedgerUnwritable as err:
                    log.warning("ledger: periodic checkpoint skipped: %s", err.message)
                except Exception:
                    log.exception("ledger: periodic checkpoint failed")

    # ---- stats / close ----------------------------------------------------------------------

    @property
    def stats(self) -> LedgerStats:
        s = self._stats
        cumulative, total = [], 0
        for bound, count in zip((*FSYNC_BUCKETS, float("inf")), s.buckets, strict=True):
            total += count
            cumulative.append((bound, total))
        return LedgerStats(
            appends=s.appends,
            batches=s.batches,
            fsync_count=s.fsync_count,
            fsync_seconds_sum=s.fsync_sum,
            fsync_buckets=cumulative,
            size=self._size,
        )

    async def close(self) -> None:
        """Finish queued appends, checkpoint, sync the derived files, release the lock."""
        if self._closed:
            return
        self._closed = True
        for task in (self._ticker, self._prober):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        if self._writer is not None:
            self._queue.put(None)
            await self._writer
        loop = asyncio.get_running_loop()
        try:
            if not self.readonly and self._failed is None:
                await self._close_outage(loop)
            if not self.readonly and self._failed is None and self._outage is None:
                latest = self._latest
                try:
                    if latest is None or latest.size != self._size:
                        self._latest = await loop.run_in_executor(self._executor, self._checkpoint)
                    else:
                        await loop.run_in_executor(self._executor, self._sync_derived)
                except (LedgerFailed, OSError) as err:
                    log.warning("ledger: closing without a final checkpoint: %s", err)
        finally:
            await loop.run_in_executor(self._executor, self._release)
            self._executor.shutdown(wait=True)
            self._syncer.shutdown(wait=True)

    async def _close_outage(self, loop: asyncio.AbstractEventLoop) -> None:
        """One last probe, so a disk that came back lets close checkpoint as usual."""
        outage = self._outage
        if outage is None:
            return
        try:
            await loop.run_in_executor(self._executor, self._probe, outage)
        except OSError as err:
            log.warning("ledger: closing while the disk still refuses writes (%s)", err)
            return
        self._outage = None

    async def abandon(self) -> None:
        """Drop the handle as a crash would (no checkpoint, no derived sync); for tests."""
        self._closed = True
        for task in (self._ticker, self._prober, self._writer):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await asyncio.get_running_loop().run_in_executor(self._executor, self._release)
        self._executor.shutdown(wait=True)
        self._syncer.shutdown(wait=True)

    def _release(self) -> None:
        with contextlib.suppress(AttributeError):
            self.tree.close()
        with contextlib.suppress(AttributeError):
            self.bodies.close()
        for fd in (self._entries_fd, self._lock_fd):
            if fd >= 0:
                os.close(fd)
        self._entries_fd = self._lock_fd = -1

    async def __aenter__(self) -> Ledger:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _hex(data: bytes) -> bytes | None:
    try:
        return bytes.fromhex(data.decode("ascii"))
    except ValueError:
        return None


def _ts(line: bytes) -> bytes | None:
    """The `ts` of a canonical entry line, unparsed (keys are sorted: `ts` follows `seq`)."""
    at = line.rfind(b',"ts":')
    return line[at + 6 :].split(b",")[0] if at >= 0 else None


def _only_junk(fd: int, offset: int) -> bool:
    """True if nothing after `offset` is a complete line (zero fill or a partial write)."""
    rest = os.pread(fd, 1 << 20, offset)
    return b"\n" not in rest.rstrip(b"\x00")
