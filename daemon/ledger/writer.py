"""The writer: group commit through the journal, rollback of a failed batch, outages, redaction.

One piece (past 500 lines) because a commit, its rollback, the outage it may open and the
redaction that rides on a commit all change the same files under the one invariant below.

Durability invariant (stated here once; the other parts refer to it). A batch is committed as:
its record (pack records + entry lines, with their offsets) written to the journal, the same
bytes written to `bodies.pack` and `entries.jsonl`, then ONE fdatasync, of the journal; only
once it has returned are the appenders' futures resolved. So an acknowledged batch is always
whole in the journal, or (after a catch-up) in the record files, fsynced: a catch-up, between
batches, fsyncs the record files and only then rotates the journal to a base at their end (see
`journal`). Readers see an acknowledged batch at once: its bytes are in the files' page cache
before its futures resolve. A crash may leave a batch whose journal record is not whole; it was
never acknowledged, and recovery cuts it from the files, so nothing of it stays half-present.
Only one batch is ever unacknowledged (the writer commits one at a time).

Write failures (ENOSPC, EDQUOT, EIO: see `outage`). A batch whose write or fdatasync fails is
never acknowledged and never synced again: after a failed sync the page cache may hold pages the
disk never got, and a second sync on the same description would report success for them. So the
batch is rolled back (the tree and body table in memory, then the journal, the entries and the
pack are truncated to the offsets of the last acknowledged batch on fresh file descriptions, and
synced), its appenders get `LedgerUnwritable` (503), and an outage begins: appends fail fast, a
probe retries with backoff (finishing a rollback that failed too), and appends resume when the
disk takes a write + fsync again. A caller that retries writes its entry anew. A failure after
the journal's fdatasync returned (a catch-up, the derived files) does not undo the batch (it is
durable in the journal): it is acknowledged and the outage begins after it; the probe rewrites
the record files from the journal on fresh descriptions before it syncs them (a failed fsync may
have dropped their pages) and only then rotates the journal. If the process dies before a
failed rollback is finished, the unacknowledged batch may survive whole, as it may in any crash.

Redaction invariant. `redact` makes the `redaction` entry durable first and zeroes the body
second. A crash in between is repaired on open: `meta.json`'s `redact_from` is the lowest seq
of a redaction not yet zeroed when the derived files were last synced (else their size), and
open re-applies every `redaction` entry from there (and from the unindexed tail) on (see
`recovery`), so a witnessed redaction always ends with its body gone.
"""

from __future__ import annotations

import asyncio
import bisect
import functools
import hashlib
import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from hashlib import sha256
from typing import Any

from pydantic import BaseModel

from daemon import layout
from daemon.errors import InvalidInput, NotFound
from daemon.ledger.canonical import NotCanonical, canonicalize, check_text
from daemon.ledger.entry import (
    VERSION,
    Entry,
    line_template,
)
from daemon.ledger.errors import LedgerFailed, LedgerUnwritable
from daemon.ledger.handle import Handle
from daemon.ledger.journal import MAX_BATCH
from daemon.ledger.merkle import Frontier
from daemon.ledger.outage import LedgerHealth, Mark, Outage, probe
from daemon.ledger.store import (
    MARKS,
    add_mark,
    reopen,
    write_all,
    write_atomic,
)

log = logging.getLogger(__name__)


MAX_BATCH_BYTES = 1 << 20
SYNC_EVERY = 16384  # fsync the derived files at least this often (bounds recovery rescans)
JOURNAL_MAX = 8 << 20  # catch the record files up (and rotate the journal) past this
JOURNAL_SPACE = JOURNAL_MAX + 2 * MAX_BATCH_BYTES + (1 << 20)  # the journal file's length
FSYNC_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)

_set = object.__setattr__
_FIELDS = set(Entry.model_fields)


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
    on_commit: Callable[[Entry], None] | None = None


class _Stalled(Exception):
    """Writer thread: a write or fsync failed. `entries`: the batch was durable anyway (only
    the derived files failed after its fsyncs), else it was rolled back."""

    def __init__(self, outage: Outage, entries: list[Entry] | None) -> None:
        super().__init__(outage.detail)
        self.outage = outage
        self.entries = entries


@dataclass(slots=True)
class _Job:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    future: Future[Any]


class WriterThread(Executor):
    """The one writer thread, fed in order with batches of appends and jobs.

    Appends queued by the event loop in one iteration are handed over together (one lock, one
    wake-up), and the thread takes everything queued when it is free as the next batch
    (`MAX_BATCH`, `MAX_BATCH_BYTES`), so batches grow with the load while one is syncing.
    Everything else that must not run beside a commit (open, checkpoints, probes, redaction
    zeroing, repairs) is a job, through `loop.run_in_executor(thread, ...)`, run between
    batches in the order it was queued. `submit` and `put` are for the loop thread only.
    """

    def __init__(self, commit: Callable[[list[_Pending]], None]) -> None:
        self._commit = commit
        self._items: deque[_Pending | _Job | None] = deque()
        self._cond = threading.Condition(threading.Lock())
        self._idle = False
        self._loose: list[_Pending] = []  # queued in this loop iteration, not handed over yet
        self._thread = threading.Thread(target=self._run, name="ledger-writer", daemon=True)
        self._thread.start()

    def put(self, item: _Pending) -> None:
        if not self._loose:
            asyncio.get_running_loop().call_soon(self._hand_over)
        self._loose.append(item)

    def _hand_over(self, job: _Job | None = None) -> None:
        loose, self._loose = self._loose, []
        with self._cond:
            self._items.extend(loose)
            if job is not None:
                self._items.append(job)
            if self._idle:
                self._cond.notify()

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        call = functools.partial(fn, **kwargs) if kwargs else fn
        self._hand_over(_Job(call, args, future))  # after the appends queued before it
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        if self._thread.is_alive():
            with self._cond:
                self._items.append(None)
                self._cond.notify()
            if wait:
                self._thread.join()

    def _run(self) -> None:
        items, cond = self._items, self._cond
        while True:
            with cond:
                while not items:
                    self._idle = True
                    cond.wait()
                self._idle = False
                head = items.popleft()
                if type(head) is _Pending:
                    batch, size = [head], len(head.body or b"")
                    while items and len(batch) < MAX_BATCH and size < MAX_BATCH_BYTES:
                        item = items[0]
                        if type(item) is not _Pending:
                            break
                        batch.append(item)
                        size += len(item.body or b"")
                        items.popleft()
            if head is None:
                return
            if type(head) is _Job:
                if head.future.set_running_or_notify_cancel():
                    try:
                        result = head.fn(*head.args)
                    except BaseException as err:
                        head.future.set_exception(err)
                    else:
                        head.future.set_result(result)
                continue
            self._commit(batch)


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


@dataclass(slots=True)
class Encoded:
    """A batch's canonical lines on a head: what every storage writes (see `encode_batch`)."""

    lines: list[bytes]
    leaves: list[bytes]
    ends: list[int]
    entries: list[Entry]
    redactions: list[tuple[int, bytes]]
    prev: str
    end: int


def encode_batch(batch: list[_Pending], seq: int, prev: str, ts: int, end: int = 0) -> Encoded:
    """The batch's canonical lines on the head (`seq`, `prev`), stamped `ts`: each line, its
    RFC 9162 leaf hash, where it ends in an entries file starting at `end`, the Entry handed
    back, and the redactions it witnesses. The one place lines are built, whatever the storage
    (writer thread)."""
    # One pass: each line (`entry.fill_line`, inlined: the call costs more than the format),
    # its leaf hash, where it ends, and the Entry handed back (built as `model_construct`
    # would, minus its per-field work: every field is checked).
    sha256, new_entry, version, fields = hashlib.sha256, Entry.__new__, VERSION, _FIELDS
    lines: list[bytes] = []
    leaves: list[bytes] = []
    ends: list[int] = []
    entries: list[Entry] = []
    redactions: list[tuple[int, bytes]] = []
    for p in batch:
        line = f'{p.head}{prev}{p.tail}{seq},"ts":{ts},"v":{version}}}'.encode()
        leaf = sha256(b"\x00" + line).digest()
        leaf_hex = leaf.hex()
        end += len(line) + 1
        lines.append(line)
        leaves.append(leaf)
        ends.append(end)
        entry = new_entry(Entry)
        _set(
            entry,
            "__dict__",
            {
                "v": version,
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
        _set(entry, "__pydantic_fields_set__", fields.copy())
        _set(entry, "__pydantic_extra__", None)
        _set(entry, "__pydantic_private__", None)
        entries.append(entry)
        if p.redacts is not None:
            redactions.append((seq, p.redacts))
        prev = leaf_hex
        seq += 1
    return Encoded(lines, leaves, ends, entries, redactions, prev, end)


class Writer(Handle):
    """The writer's side of `Ledger` (module doc)."""

    _entries_end: int
    _last_hash: str
    _last_ts: int
    _synced: int
    _prober: asyncio.Task[None] | None
    _write_failures: int
    _stats: _Stats
    _executor: WriterThread
    _loop: asyncio.AbstractEventLoop
    _halted: Outage | None  # writer thread: a batch stalled; refuse batches until a probe ends it
    _broken: LedgerFailed | None  # writer thread: a bug mid-commit; refuse every batch
    _outage_ends = "the disk takes writes again"  # how an outage ends, for the log
    step_hook: Callable[[str], None] | None = None
    """Fault injection, for tests: called on the writer thread with the name of each step of
    a commit and of a catch-up as it completes ("journal written", "pack written", "entries
    written", "journal synced"; "entries synced", "pack synced", "journal rotated"), so a test
    can stop the process between any two of them."""

    def _check_writable(self) -> None:
        """Refuse at once while the ledger failed, an outage lasts, or it is closed/read-only."""
        if self._failed is not None:
            raise self._failed
        if self._outage is not None:
            raise self._outage.error()
        if self.readonly or self._closed:
            raise LedgerFailed("the ledger is closed or read-only")

    async def append(
        self,
        *,
        actor: str,
        kind: str,
        body: Any = None,
        run: str | None = None,
        parent: int | None = None,
        on_commit: Callable[[Entry], None] | None = None,
    ) -> Entry:
        """Append one entry; returns once it (and its body) are fsynced.

        `on_commit(entry)` is called on the loop as the entry is acknowledged, in seq order,
        before any caller resumes, and even if this caller stopped waiting (a cancelled wait
        does not undo the commit): what must follow every committed entry goes there. It is
        never called for an append that fails."""
        return await self.append_soon(
            actor=actor, kind=kind, body=body, run=run, parent=parent, on_commit=on_commit
        )

    def append_soon(
        self,
        *,
        actor: str,
        kind: str,
        body: Any = None,
        run: str | None = None,
        parent: int | None = None,
        on_commit: Callable[[Entry], None] | None = None,
    ) -> asyncio.Future[Entry]:
        """`append` without a coroutine, for a caller that overlaps the commit with other
        work: refuses now what `append` refuses, and returns the future of the entry, resolved
        once it is fsynced. Cancelling the future cancels only the wait, as in `append`."""
        self._check_writable()
        data = check_append(
            actor=actor, kind=kind, body=body, run=run, parent=parent, size=self._size
        )
        return self._enqueue(actor, kind, run, parent, data, None, on_commit)

    def _enqueue(
        self,
        actor: str,
        kind: str,
        run: str | None,
        parent: int | None,
        data: bytes | None,
        redacts: bytes | None,
        on_commit: Callable[[Entry], None] | None = None,
    ) -> asyncio.Future[Entry]:
        """Queue checked fields; the encoding and body hash happen here, off the writer."""
        future: asyncio.Future[Entry] = self._loop.create_future()
        if data is None:
            digest = body_hex = None
        else:
            digest = sha256(data).digest()
            body_hex = digest.hex()
        head, tail = line_template(actor, kind, run, parent, body_hex)
        self._executor.put(
            _Pending(
                actor,
                kind,
                run,
                parent,
                data,
                digest,
                body_hex,
                head,
                tail,
                future,
                redacts,
                on_commit,
            )
        )
        # A cancelled caller cancels only its wait: the writer skips done futures and still
        # commits the entry, so nothing acknowledged is ever undone.
        return future

    def _commit_batch(self, batch: list[_Pending]) -> None:
        """Writer thread: commit a batch (or refuse it: the ledger failed, or an outage
        began and no probe has ended it yet), then settle its futures on the loop with one
        `call_soon_threadsafe`."""
        outcome: list[Entry] | BaseException
        outage = None
        if self._broken is not None:
            outcome = self._broken
        elif self._halted is not None:
            outcome = self._halted.error()
        else:
            try:
                outcome = self._commit(batch)
            except _Stalled as stall:
                outage = self._halted = stall.outage
                outcome = stall.outage.error() if stall.entries is None else stall.entries
            except LedgerFailed as err:  # the storage found the record in a state it cannot extend
                log.critical("ledger: refusing further appends: %s", err.message)
                outcome = self._broken = err
            except Exception as err:
                log.critical("ledger: write or fsync failed, refusing further appends: %s", err)
                outcome = self._broken = LedgerFailed(f"ledger write failed: {err}")
        self._loop.call_soon_threadsafe(self._settle, batch, outcome, outage)

    def _settle(
        self, batch: list[_Pending], outcome: list[Entry] | BaseException, outage: Outage | None
    ) -> None:
        """Loop thread: resolve a batch's futures (a cancelled caller cancelled only its wait:
        its entry is committed all the same)."""
        if outage is not None:
            self._begin_outage(outage)
        if isinstance(outcome, BaseException):
            if isinstance(outcome, LedgerFailed):
                self._failed = outcome
            for pending in batch:
                if not pending.future.done():
                    pending.future.set_exception(outcome)
            return
        if outcome:  # a shared record's batch may land past entries other daemons appended
            self._size = max(self._size, outcome[-1].seq + 1)
        for pending, entry in zip(batch, outcome, strict=True):
            if pending.on_commit is not None:
                _call(pending.on_commit, entry)
            if not pending.future.done():
                pending.future.set_result(entry)

    def _commit(self, batch: list[_Pending]) -> list[Entry]:
        """Writer thread: commit a batch, or roll it back and raise `_Stalled` (module doc)."""
        mark = Mark(
            self.tree.size, self._entries_end_offset(), self.bodies.pack_size, self._journal.end
        )
        try:
            entries = self._write_batch(batch)
        except OSError as err:
            self._write_failures += 1
            log.error("ledger: a write or fsync failed (%s): rolling the batch back", err)
            raise _Stalled(Outage.of(err, self._rollback(mark)), None) from err
        try:
            if self.tree.size - self._synced >= SYNC_EVERY:
                self._sync_derived()
            elif self._journal.end >= JOURNAL_MAX:
                self._catch_up()
        except OSError as err:
            self._write_failures += 1
            raise _Stalled(Outage.of(err), entries) from err
        return entries

    def _write_batch(self, batch: list[_Pending]) -> list[Entry]:
        """Writer thread: encode, journal the batch, write it to the record files, one
        fdatasync (of the journal), then extend the tree (module doc)."""
        tree, bodies, hook = self.tree, self.bodies, self.step_hook
        seq, prev, end = tree.size, self._last_hash, self._entries_end_offset()
        first, start = seq, end
        ts = max(time.time_ns() // 1000, self._last_ts)
        staged: set[bytes] = set()
        for p in batch:
            digest = p.digest
            if digest is not None and digest not in staged:
                staged.add(digest)
                if not bodies.has_live(digest):
                    assert p.body is not None
                    bodies.stage(digest, p.body)
        bodies.reserve(len(staged))
        enc = encode_batch(batch, seq, prev, ts, end)
        lines, leaves, ends, entries = enc.lines, enc.leaves, enc.ends, enc.entries
        redactions, prev, end = enc.redactions, enc.prev, enc.end
        lines.append(b"")
        data = b"\n".join(lines)
        pack = bytes(bodies.pending)
        t0 = time.perf_counter()
        self._journal.append(first, start, bodies.pack_size, len(batch), pack, data)
        if hook is not None:
            hook("journal written")
        bodies.write()
        if hook is not None:
            hook("pack written")
        write_all(self._entries_fd, data)
        if hook is not None:
            hook("entries written")
        self._journal.sync()
        if hook is not None:
            hook("journal synced")
        tree.extend(leaves, ends)
        tree.flush(force=False)
        self._entries_end = end
        self._unapplied.update(redactions)
        bodies.index()  # only now: a rolled-back batch never leaves a slot in the table
        self._head = tree.frontier.snapshot()
        self._stats.observe(time.perf_counter() - t0)
        self._stats.appends += len(batch)
        self._stats.batches += 1
        self._last_hash, self._last_ts = prev, ts
        return entries

    def _catch_up(self) -> None:
        """Writer thread, between batches: fsync the record files (everything the journal
        holds is in them already), then rotate the journal to a base at their end."""
        hook = self.step_hook
        try:
            os.fsync(self._entries_fd)
            if hook is not None:
                hook("entries synced")
            self.bodies.sync_pack()
            if hook is not None:
                hook("pack synced")
            self._journal.rotate(self.tree.size, self._entries_end_offset(), self.bodies.pack_size)
        except OSError as err:
            # No batch is committed until a probe has rewritten the files from the journal: a
            # later catch-up's fsync on these descriptions could "succeed" for lost pages.
            self._halted = self._halted or Outage.of(err)
            raise
        if hook is not None:
            hook("journal rotated")

    def _restore(self) -> None:
        """Writer thread (the probe): rewrite the record files from the journal on fresh
        descriptions. A failed fsync of them may have left the page cache showing bytes the
        disk never got; only a new write makes them dirty again (see `Journal.replay`)."""
        reopen(self._entries_fd, self.dir / layout.ENTRIES, os.O_RDWR | os.O_APPEND)
        reopen(self.bodies.pack, self.bodies.pack_path, os.O_RDWR)
        self._journal.replay(self.dir / layout.ENTRIES, self.bodies.pack_path)

    def _entries_end_offset(self) -> int:
        if self._entries_end == 0 and self.tree.size:
            self._entries_end = self.tree.end(self.tree.size - 1)
        return self._entries_end

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
        """Writer thread: truncate the journal, then the record files, to `mark` on fresh
        descriptions, synced."""
        self._journal.cut(mark.journal_end)
        os.ftruncate(self._entries_fd, mark.entries_end)
        reopen(self._entries_fd, self.dir / layout.ENTRIES, os.O_RDWR | os.O_APPEND)
        os.fsync(self._entries_fd)
        self.bodies.cut(mark.pack_size)

    def _begin_outage(self, outage: Outage) -> None:
        """Loop thread: stop accepting writes and start probing for the disk's return."""
        current = self._outage
        if current is not None:
            current.rollback = current.rollback or outage.rollback
            return
        self._outage = outage
        log.error(
            "ledger: cannot write (%s): appends fail with 503 until %s",
            outage.detail,
            self._outage_ends,
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
        """Writer thread: finish the rollback, write + fsync a scratch file, rewrite the record
        files from the journal and sync them and the derived files, re-zero redactions whose
        zeroing failed. Raises OSError while the disk refuses."""
        if outage.rollback is not None:
            self._cut(outage.rollback)
            outage.rollback = None
        probe(self.dir)
        self._restore()
        self._sync_derived()  # the journal no longer holds a body zeroed below
        for seq, digest in sorted(self._unapplied.items()):
            self.bodies.redact(digest, force=True)
            self._unapplied.pop(seq, None)
        self._halted = None

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

    def _sync_derived(self) -> None:
        """Writer thread: catch the record files up, fsync the derived files and record how far
        they can be trusted (never past what the record files hold durably)."""
        if self._failed is not None:
            raise self._failed
        self._catch_up()
        self.tree.sync()
        self.bodies.sync_table()
        meta = {
            "size": self.tree.size,
            "pack": self.bodies.mark,
            "bodies": self.bodies.count,
            "redact_from": min(self._unapplied, default=self.tree.size),
            # a reader that finds no checkpoint file, or an older one, says so (recovery)
            "signed": 0 if self._latest is None else self._latest.size,
        }
        write_atomic(self.dir / layout.META, json.dumps(meta).encode())
        self._synced = self.tree.size
        add_mark(self.dir / MARKS, self.tree.size, self.bodies.mark)

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
        self._check_writable()
        if not isinstance(actor, str) or not actor:
            raise InvalidInput("actor must be a non-empty string")
        try:
            check_text(actor)
            data = canonicalize({"redacted": body_hash, "reason": reason})
        except NotCanonical as err:
            raise InvalidInput(f"not storable in the ledger: {err}") from err
        if not await asyncio.to_thread(self._has_body, digest):
            raise NotFound(f"no body {body_hash}")
        entry = await self._enqueue(actor, "redaction", None, None, data, digest)
        await self._after_redaction(entry, digest)
        return entry

    def _has_body(self, digest: bytes) -> bool:
        """Storage (any thread): whether the record holds this body (redacted or not)."""
        return self.bodies.locate(digest) is not None

    async def _after_redaction(self, entry: Entry, digest: bytes) -> None:
        """Storage: the `redaction` entry is committed; remove the body (the file storage
        zeroes it in place, second, as the redaction invariant says)."""
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

    def _apply_redaction(self, seq: int, digest: bytes) -> None:
        """Writer thread: zero the body (fsynced), then forget the pending redaction. The
        journal is rotated first, so no copy of the body is left in it (nor replayed from it)."""
        self._catch_up()
        self.bodies.redact(digest)
        self._unapplied.pop(seq, None)


def _call(on_commit: Callable[[Entry], None], entry: Entry) -> None:
    """A hook that fails is the caller's bug: logged, and the batch's other appends settle."""
    try:
        on_commit(entry)
    except Exception:
        log.exception("ledger: an on_commit hook failed for seq %d", entry.seq)
