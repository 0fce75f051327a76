"""Open-time recovery: what holds before anything is appended, served or signed.

Contract. After `_open` returns, the entries file ends at the last complete, chained entry whose
body is in the pack; the tree and index cover exactly those entries; every witnessed redaction
has its body zeroed; and the stored tree is vouched for by the latest signed checkpoint. Open
does this without re-reading the history (a compact index, the Merkle frontier, and bounded
re-checks: TAIL_CHECK, RECHECK_MAX).

- Journal: first the record files are held against the journal, writing nothing
  (`agreement.compare`). Only a crash's difference (the files a prefix of the journal, give or
  take zeros, and at most one unacknowledged batch past its end) is restored, by the owner
  alone (`Journal.replay`): what lies past its last whole record is cut, every record's bytes
  are written back at their offsets, and, once open has checked everything below, the files
  are fsynced and the journal starts a new cycle on them. Any other difference is an edit or
  damage: the owner refuses to open, naming the first seq that differs, and writes nothing
  (`_refuse`). With no usable journal (none yet; or the files end before its base, which means
  fsynced bytes are gone) the files are judged as they are, by the checks below.
- A reader (read-only open) never writes a byte of the state dir. It reads the files up to
  what the journal vouches for (not an unacknowledged batch past it) and remembers how they
  stand (`_agreement`): `verify` reports files behind the journal (a stop before the
  write-back: the owner's next open restores them) or differing from it, with the seq.
- Torn tail: a partial last line (or zero fill after a crash) is truncated back to the last
  complete entry, and fsynced, before the writer starts.
- Missing-body tail (files with no usable journal): entries whose body never reached the pack
  are dropped only when they can be the one unacknowledged batch (all with the last line's
  `ts`, at most MAX_BATCH); earlier, open refuses and names the seq.
- Derived files are checked, not trusted: an index that disagrees with the entries (the tail
  check, an end past the file) is judged against the entries walked on their own
  (`_judge_index`): rebuilt from them when they chain and add up to the checkpoint, else the
  open is refused naming the entry. The root at the latest signed checkpoint must match
  (else every node is rebuilt from the leaves, then the index judged, and if it still differs
  the open is refused; a reader opens, serves no proof, and `verify` names what is wrong),
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

from daemon import layout
from daemon.errors import NotFound
from daemon.ledger.agreement import Agreement, compare
from daemon.ledger.audit import Chain, verify_files, walk_chain
from daemon.ledger.checkpoint import Checkpoint, SignerOnDemand, load_checkpoint
from daemon.ledger.entry import (
    GENESIS_PREV,
    Entry,
)
from daemon.ledger.errors import LedgerCorrupt, LedgerLocked
from daemon.ledger.handle import Handle
from daemon.ledger.journal import FILL_STEP, MAX_BATCH, Journal
from daemon.ledger.merkle import Frontier, leaf_hash
from daemon.ledger.store import (
    INDEX_END,
    MARKS,
    BodyStore,
    Tree,
    create_dir,
    marks_before,
    open_append,
    read_meta,
)
from daemon.ledger.writer import JOURNAL_SPACE

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


class Recovery(Handle):
    """Open and recovery, on the writer thread before the writer starts (module doc)."""

    def _open(self) -> None:
        entries, pack = self.dir / layout.ENTRIES, self.dir / layout.BODIES_PACK
        if self.readonly:
            if not self.dir.is_dir():
                raise NotFound(f"no ledger in {self.state_dir}")
            # A running owner keeps the files current (it replayed at its own open): a reader
            # compares nothing then (a commit in flight is not a difference).
            if not self._owner_running():
                self._agreement = compare(self.dir, entries, pack)
                if self._agreement.state in ("ahead", "behind"):
                    self._entries_limit = self._agreement.entries_end
        else:
            create_dir(self.dir)
            self._take_lock()
            self._agreement = compare(self.dir, entries, pack)
            if self._agreement.state == "differs":
                self._refuse(self._agreement)
        self._open_files()

    def _open_files(self) -> None:
        meta = read_meta(self.dir / layout.META)
        trusted = int(meta.get("size", 0))
        self.tree = Tree(self.dir, not self.readonly, trusted)
        entries_path = self.dir / layout.ENTRIES
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
            if not self.readonly:  # a reader appends nothing: it needs no `ts` (nor a parse)
                self._last_ts = self._read_entry(self._size - 1).ts
        if self.readonly:
            vkey_path = self.dir / layout.CHECKPOINT_VKEY
            self._vkey = vkey_path.read_text().strip() if vkey_path.exists() else None
        else:
            self._signer = SignerOnDemand(self.dir)
        self._latest = load_checkpoint(self.dir / layout.CHECKPOINT)
        self._checkpoint_gone = _checkpoint_gone(meta, self._latest)
        if self._checkpoint_gone is not None and not self.readonly:
            log.warning("ledger: %s", self._checkpoint_gone)
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
        them: only ever after `compare` found a crash's difference (or none). With no journal
        to trust (none yet, or files shorter than its base), nothing is touched: the checks
        below judge the files as they are."""
        self._journal = Journal(self.dir, JOURNAL_SPACE)
        os.close(open_append(self.dir / layout.BODIES_PACK, append=False))  # created if new
        last = self._journal.replay(self.dir / layout.ENTRIES, self.dir / layout.BODIES_PACK)
        if self._agreement is not None and self._agreement.state == "none":
            if self._agreement.reason:
                log.warning("ledger: %s", self._agreement.reason)
        elif last is not None and self._agreement is not None and self._agreement.state != "same":
            log.warning(
                "ledger: restored the record files from the journal up to seq %d (%s)",
                last.next_seq,
                self._agreement.reason,
            )

    def _refuse(self, agreement: Agreement) -> None:
        """Owner: the record files differ from the journal in a way no crash leaves (an edit,
        or damage). Nothing is written: the files are opened as a reader would, walked to name
        the first entry that differs (the journal's word when it says an earlier one), and the
        open is refused with what to do. The evidence stays as it is."""
        self.readonly = True
        seq, reason = agreement.seq, agreement.reason
        try:
            self._open_files()
            pinned = None
            if self._latest is not None and self._latest.size <= self.tree.size:
                pinned = (self._latest.size, bytes.fromhex(self._latest.root))
            report = verify_files(
                self.dir / layout.ENTRIES, self.tree, self.bodies, self.tree.size, False, pinned
            )
            walked = report.first_bad_seq if not report.ok else None
            if walked is not None and (seq is None or walked < seq):
                seq, reason = walked, f"{report.reason} ({reason})"
        except LedgerCorrupt as err:
            if seq is None or err.seq < seq:
                seq, reason = err.seq, f"{err.reason} ({reason})"
        raise LedgerCorrupt(
            self.tree.size if seq is None else seq,
            f"{reason}. The daemon will not open it, and changed nothing: keep the state dir as "
            "evidence, see `tally ledger verify`, and restore the ledger from a copy you trust",
        )

    def _owner_running(self) -> bool:
        """Whether a process holds the ledger's lock (a probe: no lock is kept)."""
        try:
            fd = os.open(self.dir / layout.LOCK, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return False  # never opened writable, or unreadable
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)  # also lets go of the shared lock
        return False

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
                self._judge_index()  # raises if the entries are what is wrong
                fixed, tree.frontier = tree.recheck(0)
            if tree.root(signed).hex() != latest.root:
                err = LedgerCorrupt(
                    signed - 1,
                    "tree differs from the latest checkpoint even rebuilt from the leaf hashes "
                    "(`tally ledger verify` names the entry)",
                )
                if not self.readonly:
                    raise err
                # A reader opens anyway: `verify` walks the entries themselves and says whether
                # they or the index are wrong; it serves no proof (see `Reader._checked`).
                self._unanchored = err
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
        """Take the ledger's lock and write our pid into its file; a holder is refused at once
        (readers never take it: they write nothing)."""
        path = self.dir / layout.LOCK
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
            os.close(fd)
            raise LedgerLocked(
                str(self.state_dir), int(holder) if holder.isdigit() else None
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    def _file_size(self) -> int:
        """The entries file's size, or, for a reader, where the journal vouches for it up to
        (an unacknowledged batch, or lines the owner would restore, lie past it)."""
        if self._entries_fd < 0:
            return 0
        size = os.fstat(self._entries_fd).st_size
        return size if self._entries_limit is None else min(size, self._entries_limit)

    def _recover(self) -> None:
        """Check the indexed tail, then extend the index over the unindexed entries.

        Only the last `tail_check` indexed entries are re-hashed (see TAIL_CHECK).
        """
        tree = self.tree
        n = tree.size
        file_size = self._file_size()
        if n and tree.end(n - 1) > file_size:
            self._judge_index()
            n = tree.size
        first = max(0, n - self._tail_check)
        if n > first:
            start, end = tree.end(first - 1), tree.end(n - 1)
            lines = os.pread(self._entries_fd, end - start, start).split(b"\n")[:-1]
            if len(lines) != n - first or any(
                leaf_hash(line) != tree.leaf(first + i) for i, line in enumerate(lines)
            ):
                self._judge_index()
        offset = tree.end(n - 1)
        prev = tree.leaf(n - 1).hex() if n else GENESIS_PREV
        buf = b""
        while True:
            want = min(READ_CHUNK, file_size - offset - len(buf))  # a reader's limit, if any
            chunk = os.pread(self._entries_fd, want, offset + len(buf)) if want > 0 else b""
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
                    if (
                        missing_body
                        or rest == 0
                        or _only_junk(self._entries_fd, line_end, file_size)
                    ):
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

    def _judge_index(self) -> None:
        """The index disagrees with the entries file (an end past the file, a leaf hash in the
        tail check, a root that does not add up to the checkpoint). It is a cache: the entries
        file is walked on its own (`walk_chain`, O(entries): only on this path) to tell which
        is wrong. If the indexed entries chain, add up to the latest signed checkpoint, and
        each is vouched for by the next one's link or the checkpoint, the index is rebuilt from
        them (in memory for a reader: `verify` lists it). Else the entries are damaged, and open
        is refused naming the first seq: where the chain breaks, or the line before it if the
        index does not hold its hash either (that line was changed, or one was put before)."""
        tree, n = self.tree, self.tree.size
        # One line more than the index holds, if the file has it: its link vouches for the last.
        chain = walk_chain(self._entries_fd, n + 1, self._file_size())
        k = len(chain.leaves)
        if chain.bad is not None and chain.bad < n:
            if k > 0 and chain.leaves[k - 1] != tree.leaf(k - 1):
                # Neither the index nor the next line's link holds this line's hash: it changed.
                raise LedgerCorrupt(k - 1, "entry bytes do not match the recorded leaf hash")
            raise LedgerCorrupt(k, chain.reason)
        latest = load_checkpoint(self.dir / layout.CHECKPOINT)
        signed = latest.size if latest is not None and latest.size <= n else 0
        if latest is not None and signed:
            frontier = Frontier()
            frontier.push_many(chain.leaves[:signed])
            if frontier.root().hex() != latest.root:
                wrong = next(
                    (i for i in range(signed) if chain.leaves[i] != tree.leaf(i)), signed - 1
                )
                raise LedgerCorrupt(
                    wrong, "the entries do not add up to the latest signed checkpoint"
                )
        if n > signed and k == n and chain.leaves[n - 1] != tree.leaf(n - 1):
            # The last entry has no successor and no checkpoint to vouch for it: only the
            # index says what it was.
            raise LedgerCorrupt(n - 1, "entry bytes do not match the recorded leaf hash")
        first = next(i for i in range(n) if tree.index.read(i) != _index_record(chain, i))
        tree.truncate(0)
        tree.extend(chain.leaves[:n], chain.ends[:n])
        note = f"index.bin: entry {first} and on did not match the entries; rebuilt from them" + (
            " in memory (read-only)" if self.readonly else ""
        )
        log.warning("ledger: %s", note)
        self._index_note = note

    def _one_batch(self, offset: int) -> bool:
        """True if the complete lines from `offset` on can be one batch (at most MAX_BATCH, all
        with the first one's `ts`): the only tail a crash can leave unacknowledged."""
        ts: bytes | None = None
        count, buf, at, size = 0, b"", offset, self._file_size()
        while True:
            chunk = os.pread(self._entries_fd, min(READ_CHUNK, max(size - at, 0)), at)
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


def _index_record(chain: Chain, i: int) -> bytes:
    return chain.leaves[i] + INDEX_END.pack(chain.ends[i])


def _hex(data: bytes) -> bytes | None:
    try:
        return bytes.fromhex(data.decode("ascii"))
    except ValueError:
        return None


def _ts(line: bytes) -> bytes | None:
    """The `ts` of a canonical entry line, unparsed (keys are sorted: `ts` follows `seq`)."""
    at = line.rfind(b',"ts":')
    return line[at + 6 :].split(b",")[0] if at >= 0 else None


def _only_junk(fd: int, offset: int, end: int) -> bool:
    """True if nothing in [offset, end) is a complete line (zero fill or a partial write)."""
    rest = os.pread(fd, min(1 << 20, max(end - offset, 0)), offset)
    return b"\n" not in rest.rstrip(b"\x00")


def _checkpoint_gone(meta: dict[str, object], latest: Checkpoint | None) -> str | None:
    """What is wrong when meta.json names a checkpoint larger than the checkpoint file holds
    (the file deleted, or replaced by an older one: either hides what it vouched for)."""
    signed = meta.get("signed", 0)
    if not isinstance(signed, int) or isinstance(signed, bool) or signed <= 0:
        return None
    have = 0 if latest is None else latest.size
    if have >= signed:
        return None
    found = "is missing" if latest is None else f"holds an older one (size {have})"
    return (
        f"the checkpoint file {found}, but meta.json records a signed checkpoint at size "
        f"{signed}: it was deleted or replaced. Restore ledger/checkpoint from a copy you "
        "trust, or compare with a checkpoint you saved (`tally ledger verify --since FILE`); "
        "the daemon's next checkpoint signs the record as it is then"
    )
