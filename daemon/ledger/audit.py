"""Full verification of a ledger's files: chain, leaf hashes, Merkle root, and (deep) bodies.

The fast path (chain, leaf hashes, Merkle root, pinned checkpoint) never parses JSON: in
canonical entries the key `"prev":"` can only occur as the key itself (any quote inside a
string value is escaped), so the link is a slice of the line.
Deep verify also parses every line (canonical form, field types, seq) and re-hashes bodies.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from hashlib import sha256
from itertools import accumulate
from pathlib import Path

from pydantic import BaseModel

from daemon.ledger.entry import GENESIS_PREV, Entry
from daemon.ledger.merkle import EMPTY_ROOT, node_hash
from daemon.ledger.store import INDEX_RECORD, BodyStore, Tree

_RECORD = struct.Struct("<32sQ")  # an index.bin record: leaf hash, end offset
_PLUS_ONE = (1).__add__

CHUNK_ENTRIES = 65536
READ_BYTES = 1 << 22
_PREV = b'"prev":"'


class VerifyReport(BaseModel):
    ok: bool
    size: int
    root: str
    first_bad_seq: int | None = None
    reason: str | None = None
    redacted: list[str] = []
    tampered: list[str] = []
    derived: list[str] = []
    """Derived files (index, tree levels, body table) that do not match the entries: caches, so
    the record is intact; a writer rebuilds what it can (see `rebuilt`)."""
    rebuilt: list[str] = []
    """What a writer rebuilt after finding `derived` problems (read-only openers rebuild none)."""
    tampered_why: dict[str, str] = {}
    """Deep: per tampered body hash, `changed` (its bytes no longer hash to it) or `missing (no
    redaction witnessed)` (removed or zeroed with no `redaction` entry naming it: an unwitnessed
    removal is tampering, not a redaction)."""


CHANGED = "changed"
MISSING = "missing (no redaction witnessed)"


class _Bad(Exception):
    def __init__(self, seq: int, reason: str) -> None:
        super().__init__(reason)
        self.seq = seq
        self.reason = reason


def verify_files(
    entries_path: Path,
    tree: Tree,
    bodies: BodyStore,
    size: int,
    deep: bool,
    pinned: tuple[int, bytes] | None = None,
) -> VerifyReport:
    """Re-hash entries [0, size) and compare with the stored tree (and a pinned (size, root)).

    The entries are read in file order, not through the index, so the index's offsets are
    checked like everything else derived: every leaf hash and end offset in `index.bin`, every
    node in `tree/level-*.bin` and (deep) the body table. A derived mismatch does not stop the
    walk: it is listed in `derived`, and the record itself is still judged.
    """
    stack: list[tuple[int, bytes]] = []
    redacted: list[str] = []
    tampered: list[str] = []
    witnessed: set[str] = set()
    changed: set[str] = set()  # tampered bodies whose (altered) bytes are still there
    derived = _Derived()
    first_tampered: int | None = None
    root_hex = ""
    try:
        with open(entries_path, "rb", buffering=0) as f:
            reader = _Lines(f.fileno())
            prev = GENESIS_PREV.encode()
            seq = 0
            offset = 0
            while seq < size:
                stop = min(size, seq + CHUNK_ENTRIES)
                index = tree.index.read_range(seq, stop)
                lines = reader.take(stop - seq)
                if len(index) != (stop - seq) * INDEX_RECORD:
                    derived.add(f"index.bin ends at entry {seq + len(index) // INDEX_RECORD}")
                    raise _Bad(seq, "the index is shorter than the ledger")
                pin = pinned[0] - seq if pinned is not None else -1
                done: list[list[bytes]] = [[] for _ in range(64)]  # completed nodes, per level
                for i, line in enumerate(lines):
                    h = sha256(b"\x00" + line).digest()
                    at = line.find(_PREV)
                    if at < 0 or line[at + 8 : at + 72] != prev:
                        raise _Bad(seq + i, _link_reason(line, seq + i))
                    rec = i * INDEX_RECORD
                    if index[rec : rec + 32] != h:
                        raise _Bad(seq + i, "entry bytes do not match the recorded leaf hash")
                    if deep:
                        first_tampered = _check_deep(
                            seq + i,
                            line,
                            bodies,
                            _Seen(redacted, tampered, witnessed, changed),
                            first_tampered,
                        )
                    prev = h.hex().encode()
                    # Inline Frontier.push: this loop is the verify throughput.
                    level = 0
                    while stack and stack[-1][0] == level:
                        h = sha256(b"\x01" + stack.pop()[1] + h).digest()
                        level += 1
                        done[level].append(h)
                    stack.append((level, h))
                    if i + 1 == pin and pinned is not None and _fold(stack) != pinned[1]:
                        raise _Bad(seq + i, "root differs from the checkpoint at this size")
                if len(lines) < stop - seq:
                    raise _Bad(
                        seq + len(lines),
                        f"the entries file ends before entry {seq + len(lines)} "
                        f"(the index holds {size}): entries from there on are missing",
                    )
                # The lines' ends, computed in C: offset + the running sum of (length + 1).
                ends = list(accumulate(map(_PLUS_ONE, map(len, lines)), initial=offset))[1:]
                if ends:
                    offset = ends[-1]
                derived.ends(seq, index, ends)
                derived.nodes(tree, seq, done)
                seq = stop
        root = _fold(stack)
        root_hex = root.hex()
        if deep:
            derived.problems += bodies.audit()
    except _Bad as bad:
        return VerifyReport(
            ok=False,
            size=size,
            root=root_hex,
            first_bad_seq=bad.seq,
            reason=bad.reason,
            redacted=redacted,
            tampered=tampered,
            derived=derived.listed(),
        )
    unwitnessed = [h for h in redacted if h not in witnessed]
    if unwitnessed:
        tampered.extend(unwitnessed)
        redacted = [h for h in redacted if h in witnessed]
    why = {h: CHANGED if h in changed else MISSING for h in tampered}
    reason = "tampered bodies" if tampered else None
    if derived.problems and not tampered:
        reason = DERIVED
    return VerifyReport(
        ok=not tampered and not derived.problems,
        size=size,
        root=root_hex,
        first_bad_seq=first_tampered,
        reason=reason,
        redacted=redacted,
        tampered=tampered,
        tampered_why=why,
        derived=derived.listed(),
    )


DERIVED = "derived files do not match the entries (the entries themselves are intact)"
MAX_LISTED = 20


class _Derived:
    """Mismatches found in derived files (caches of the entries): counted, the first listed."""

    def __init__(self) -> None:
        self.problems: list[str] = []
        self.count = 0

    def add(self, problem: str) -> None:
        self.count += 1
        if len(self.problems) < MAX_LISTED:
            self.problems.append(problem)

    def ends(self, first_seq: int, index: bytes, ends: list[int]) -> None:
        """Compare a chunk's line ends with the end offsets in its index records."""
        stored = [end for _, end in _RECORD.iter_unpack(index[: len(ends) * INDEX_RECORD])]
        if stored == ends:
            return
        for i, (found, actual) in enumerate(zip(stored, ends, strict=True)):
            if found != actual:
                seq = first_seq + i
                self.add(f"index.bin: entry {seq} ends at offset {actual}, the index says {found}")

    def nodes(self, tree: Tree, first_seq: int, done: list[list[bytes]]) -> None:
        """Compare the nodes a chunk completed with the stored ones, level by level."""
        for level, digests in enumerate(done):
            if not digests:
                continue
            first = first_seq >> level  # the first node a chunk completes holds its first leaf
            name = f"tree/level-{level:02d}.bin"
            if level >= len(tree.levels):
                self.add(f"{name}: missing ({len(digests)} nodes from node {first})")
                continue
            try:
                stored = tree.levels[level].read_range(first, first + len(digests))
            except OSError:
                stored = b""
            if stored == b"".join(digests):
                continue
            for k, digest in enumerate(digests):
                if stored[k * 32 : k * 32 + 32] != digest:
                    i = first + k
                    a, b = i << level, ((i + 1) << level) - 1
                    self.add(f"{name}: node {i} (entries {a}..{b}) does not match the entries")

    def listed(self) -> list[str]:
        more = self.count - len(self.problems)
        return self.problems + ([f"... and {more} more"] if more > 0 else [])


class _Lines:
    """The entries file's lines in file order (not through the index), read in big blocks."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.pos = 0
        self.rest = b""
        self.ready: list[bytes] = []
        self.at = 0

    def take(self, n: int) -> list[bytes]:
        """The next n complete lines (without their newline); fewer at the end of the file."""
        out: list[bytes] = []
        while len(out) < n:
            if self.at < len(self.ready):
                want = n - len(out)
                out += self.ready[self.at : self.at + want]
                self.at += want
                continue
            block = os.pread(self.fd, READ_BYTES, self.pos)
            if not block:
                break
            self.pos += len(block)
            self.ready = (self.rest + block).split(b"\n")
            self.rest = self.ready.pop()
            self.at = 0
        return out


def _link_reason(line: bytes, seq: int) -> str:
    """Why a line does not link: a gap in the seqs if the line says so, else a broken link."""
    return gap_reason(line, seq) or "prev does not link to the previous entry"


def gap_reason(line: bytes, seq: int) -> str | None:
    """If the line where entry `seq` should be holds a later seq: which entries are missing."""
    at = line.find(b'"seq":')
    if at >= 0:
        digits = line[at + 6 : at + 26].split(b",")[0].split(b"}")[0]
        if digits.isdigit() and int(digits) > seq:
            return _gap(seq, int(digits))
    return None


def _fold(stack: list[tuple[int, bytes]]) -> bytes:
    if not stack:
        return EMPTY_ROOT
    h = stack[-1][1]
    for _, left in reversed(stack[:-1]):
        h = node_hash(left, h)
    return h


@dataclass(slots=True)
class _Seen:
    """What deep verify has found so far about bodies."""

    redacted: list[str]
    tampered: list[str]
    witnessed: set[str]  # bodies named by a `redaction` entry
    changed: set[str]  # tampered bodies whose (altered) bytes are still stored


def _check_deep(
    seq: int, line: bytes, bodies: BodyStore, seen: _Seen, first_tampered: int | None
) -> int | None:
    try:
        entry = Entry.from_line(line)
    except ValueError as err:
        raise _Bad(seq, f"entry does not parse as a canonical entry: {err}") from err
    if entry.seq != seq:
        raise _Bad(seq, f"entry says seq {entry.seq}")
    if entry.body is None:
        return first_tampered
    digest = bytes.fromhex(entry.body)
    data, is_redacted = bodies.read(digest)
    bad = False
    if is_redacted:
        if entry.body not in seen.redacted:
            seen.redacted.append(entry.body)
    elif data is None or hashlib.sha256(data).digest() != digest:
        bad = True
        if entry.body not in seen.tampered:
            seen.tampered.append(entry.body)
        if data is not None:
            seen.changed.add(entry.body)
    if entry.kind == "redaction" and data is not None:
        target = json.loads(data).get("redacted") if data.startswith(b"{") else None
        if isinstance(target, str):
            seen.witnessed.add(target)
    if bad and first_tampered is None:
        return seq
    return first_tampered


class EntriesScan(BaseModel):
    """What a plain walk of entries.jsonl found: how many entries form an intact chain."""

    intact: int
    first_bad_seq: int | None = None
    reason: str | None = None


def scan_entries(entries_path: Path) -> EntriesScan:
    """Walk the entries file without the index, to name the first missing or broken seq.

    Used after the index-driven checks refused the ledger (e.g. a file shorter than its index):
    the index cannot say which entries went missing, the entries' own seq and prev can.
    """
    prev = GENESIS_PREV
    seq = 0
    with open(entries_path, "rb") as f:
        for raw in f:
            if not raw.endswith(b"\n"):
                return EntriesScan(intact=seq, first_bad_seq=seq, reason="torn last line")
            line = raw[:-1]
            try:
                entry = Entry.from_line(line)
            except ValueError as err:
                return EntriesScan(intact=seq, first_bad_seq=seq, reason=f"does not parse: {err}")
            if entry.seq > seq:
                return EntriesScan(intact=seq, first_bad_seq=seq, reason=_gap(seq, entry.seq))
            if entry.seq != seq:
                reason = f"entry says seq {entry.seq}"
                return EntriesScan(intact=seq, first_bad_seq=seq, reason=reason)
            if entry.prev != prev:
                reason = "prev does not link to the previous entry"
                return EntriesScan(intact=seq, first_bad_seq=seq, reason=reason)
            prev = sha256(b"\x00" + line).hexdigest()
            seq += 1
    return EntriesScan(intact=seq)


def _gap(seq: int, found: int) -> str:
    missing = f"entry {seq} is" if found == seq + 1 else f"entries {seq}..{found - 1} are"
    return f"{missing} missing (the next line holds seq {found})"
