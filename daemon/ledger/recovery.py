"""Open-time recovery: what holds before anything is appended, served or signed.

Contract. After `_open` returns, the entries file ends at the last complete, chained entry whose
body is in the pack; the tree and index cover exactly those entries; every witnessed redaction
has its body zeroed; and the stored tree is vouched for by the latest signed checkpoint. Open
does this without re-reading the history (a compact index, the Merkle frontier, and bounded
re-checks: TAIL_CHECK, RECHECK_MAX).

- Journal: the record files are restored from the journal first (`Journal.replay`): what lies
  past its last whole record is cut (a batch never acknowledged), every record's bytes are
  written back at their offsets, and, once open has checked everything below, the files are
  fsynced and the journal starts a new cycle on them. With no usable journal (none yet; or the
  files end before its base, which means fsynced bytes are gone) the files are judged as they
  are, by the checks below. A read-only opener with no owner running does the same replay,
  under the owner's lock, when the files differ from the journal (else, after a power loss, it
  would read a prefix of the record); it refuses, and says why, if it cannot write them. Its
  lock file then reads "reader <pid>", and an owner opening meanwhile waits for it (seconds at
  most) instead of failing as it does against any other holder.
- Torn tail: a partial last line (or zero fill after a crash) is truncated back to the last
  complete entry, and fsynced, before the writer starts.
- Missing-body tail (files with no usable journal): entries whose body never reached the pack
  are dropped only when they can be the one unacknowledged batch (all with the last line's
  `ts`, at most MAX_BATCH); earlier, open refuses and names the seq.
- Derived files are checked, not trusted: the root at the latest signed checkpoint must match
  (else every node is rebuilt from the leaves, and if it still differs the open is refused),
  and the nodes past it are recomputed from the leaves (bounded: RECHECK_MAX). The frontier
  that results is the writer's first `_head`.
- Redactions: every `redaction` entry from `meta.json`'s `redact_from` on is re-applied
  (idempotent; see the redaction invariant in `writer`).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import time

from daemon.errors import NotFound
from daemon.ledger.audit import gap_reason
from daemon.ledger.checkpoint import Checkpoint, SignerOnDemand, load_checkpoint
from daemon.ledger.entry import (
    GENESIS_PREV,
    Entry,
)
from daemon.ledger.errors import LedgerCorrupt, LedgerFailed, LedgerLocked
from daemon.ledger.handle import Handle
from daemon.ledger.journal import FILL_STEP, Journal, Record, unapplied
from daemon.ledger.merkle import leaf_hash
from daemon.ledger.store import (
    MARKS,
    BodyStore,
    Tree,
    create_dir,
    marks_before,
    open_append,
    read_meta,
)
from daemon.ledger.writer import JOURNAL_SPACE, MAX_BATCH

log = logging.getLogger(__name__)


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
READER = "reader "  # the lock file's text while a reader restores the files: "reader <pid>"
READER_WAIT_S = 10.0  # how long an opening owner waits for such a reader (a replay takes ms)


class Recovery(Handle):
    """Open and recovery, on the writer thread before the writer starts (module doc)."""

    def _open(self) -> None:
        if self.readonly:
            if not self.dir.is_dir():
                raise NotFound(f"no ledger in {self.state_dir}")
            self._restore_for_reading()
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
            self._replay()
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
            self._signer = SignerOnDemand(self.dir)
        self._latest = load_checkpoint(self.dir / "checkpoint")
        self._anchor(self._latest)
        if not self.readonly:
            # Recovered: the files are the record now; the journal starts a new cycle on them.
            os.fsync(self._entries_fd)
            self.bodies.sync_pack()
            size = self.tree.size
            # A new journal is filled a step at a time from here (see Journal), not before
            # the first answer.
            self._journal.rotate(
                size, self.tree.end(size - 1), self.bodies.pack_size, fill=FILL_STEP
            )

    def _replay(self) -> None:
        """Restore the record files from the journal (see `journal`), before anything reads
        them. With no journal to trust (none yet, or files shorter than its base), nothing is
        touched: the checks below judge the files as they are."""
        self._journal = Journal(self.dir, JOURNAL_SPACE)
        os.close(open_append(self.dir / "bodies.pack", append=False))  # created if new
        last = self._journal.replay(self.dir / "entries.jsonl", self.dir / "bodies.pack")
        if last is not None and last.at:
            log.warning("ledger: replayed the journal up to seq %d", last.next_seq)

    def _restore_for_reading(self) -> None:
        """Read-only open: when the record files differ from the journal (a power loss before
        the owner wrote its last batches back) and no owner is running, restore them as the
        owner's open would, under its lock, so the reader sees every acknowledged entry and
        nothing a crash cut (as SQLite's readers roll back a hot journal). A running owner
        replayed at its own open and keeps the files current: the reader leaves them alone."""
        entries, pack = self.dir / "entries.jsonl", self.dir / "bodies.pack"
        if self._owner_running():
            return
        last = unapplied(self.dir, entries, pack)
        if last is None:
            return
        try:
            self._take_lock(reader=True)
        except LedgerLocked:
            return
        except OSError as err:
            raise self._cannot_restore(last, err) from err
        journal = None
        try:
            journal = Journal(self.dir, JOURNAL_SPACE)
            os.close(open_append(pack, append=False))  # created if the crash left none
            journal.replay(entries, pack)
        except OSError as err:
            raise self._cannot_restore(last, err) from err
        finally:
            if journal is not None:
                journal.close()
            os.close(self._lock_fd)
            self._lock_fd = -1
        log.warning(
            "ledger: restored the record files from the journal, which ends at %d entries "
            "(its owner had not written them back)",
            last.next_seq,
        )

    def _owner_running(self) -> bool:
        """Whether a process holds the ledger's lock (a probe: no lock is kept)."""
        try:
            fd = os.open(self.dir / "lock", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return False  # never opened writable, or unreadable: the replay's lock decides
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)  # also lets go of the shared lock
        return False

    def _cannot_restore(self, last: Record, err: OSError) -> LedgerFailed:
        return LedgerFailed(
            f"the ledger's record files differ from its journal, which ends at {last.next_seq} "
            f"entries (its owner stopped before writing them back), and cannot be restored here "
            f"({err}); start the daemon on {self.state_dir} once (its open restores them), or "
            "read a writable copy"
        )

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

    def _take_lock(self, *, reader: bool = False) -> None:
        """Take the ledger's lock and write our pid into its file ("reader <pid>" for a reader
        restoring the record files, `_restore_for_reading`). Such a reader lets go within
        moments, so an owner waits for it (up to `READER_WAIT_S`); any other holder, and any
        holder a reader meets, is refused at once."""
        path = self.dir / "lock"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        deadline = time.monotonic() + READER_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
            if reader or not holder.startswith(READER) or time.monotonic() > deadline:
                os.close(fd)
                pid = holder.removeprefix(READER)
                raise LedgerLocked(str(self.state_dir), int(pid) if pid.isdigit() else None)
            time.sleep(0.01)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{READER if reader else ''}{os.getpid()}\n".encode(), 0)
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
