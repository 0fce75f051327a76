"""Full verification of a ledger's files: chain, leaf hashes, Merkle root, and (deep) bodies.

The fast path (chain, leaf hashes, Merkle root, pinned checkpoint) never parses JSON: in
canonical entries the key `"prev":"` can only occur as the key itself (any quote inside a
string value is escaped), so the link is a slice of the line.
Deep verify also checks every line (canonical form, field types, seq) and re-hashes bodies.

Each chunk of entries is first checked in bulk (leaf hashes, links and index records compared
as whole byte strings, the Merkle levels built a level at a time, every line of the chunk held
against one linear-time pattern of the canonical entry (`lineform`, on a thread of its own),
bodies looked up in one sequential pass over the pack). The bulk check only says "all of this
chunk is right": when it cannot say so, the chunk is walked again entry by entry, exactly as
before, and that walk names the first fault and its reason. So a damaged ledger gets the same
report, and an intact one is never parsed into models.

The pass over the pack (`packscan`) may run in a child process while the entries are walked
(`packjob`): the bodies a chunk names wait for it (`_Walk.settle`) and are judged in entry
order before any entry-by-entry walk, before the end, and before a fault is reported, so what
the report says about bodies does not depend on when the scan finished.

One piece (past 500 lines) because the bulk check and the reference walk must agree on every
fault: they share the walk's state (frontier, last link, what was found) and are read together.
"""

from __future__ import annotations

import hashlib
import json
import os
from binascii import hexlify
from dataclasses import dataclass, field
from hashlib import sha256
from itertools import accumulate, repeat
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import BaseModel

from daemon.ledger.entry import GENESIS_PREV, Entry
from daemon.ledger.merkle import EMPTY_ROOT, node_hash
from daemon.ledger.store import INDEX_ENTRY, INDEX_RECORD, BodyStore, Tree

# Deep verify's own parts (the RE2 pattern, the pack scan) load at the first deep verify, not
# with the daemon: every start imports this module, few verify deeply.
if TYPE_CHECKING:
    from daemon.ledger.lineform import FormCheck
    from daemon.ledger.packjob import PackJob

_RECORD = INDEX_ENTRY  # an index.bin record: leaf hash, end offset
_PLUS_ONE = (1).__add__

CHUNK_ENTRIES = 65536
READ_BYTES = 1 << 22
_PREV = b'"prev":"'


# In a canonical line a quote inside a string is escaped, so this key occurs once, as a key.
_BODY = b'"body":"'  # then 64 hex digits (the pattern says so), or the key is `"body":null`


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
    warnings: list[str] = []
    """What does not touch the record's integrity but should be seen: an unacknowledged batch
    the owner will drop, a damaged journal base, a run snapshot that does not match."""
    tampered_why: dict[str, str] = {}
    """Deep: per tampered body hash, `changed` (its bytes no longer hash to it) or `missing (no
    redaction witnessed)` (removed or zeroed with no `redaction` entry naming it: an unwitnessed
    removal is tampering, not a redaction)."""


TAMPERED_BODIES = "tampered bodies"  # the reason of a report whose chain and tree are intact
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
    walk = _Walk(bodies, deep, pinned)
    root_hex = ""
    try:
        if deep:
            from daemon.ledger.packjob import start_scan

            walk.pack = start_scan(bodies)
        with open(entries_path, "rb", buffering=0) as f:
            reader = _Lines(f.fileno())
            seq = 0
            offset = 0
            while seq < size:
                stop = min(size, seq + CHUNK_ENTRIES)
                index = tree.index.read_range(seq, stop)
                lines = reader.take(stop - seq)
                if len(index) != (stop - seq) * INDEX_RECORD:
                    walk.derived.add(f"index.bin ends at entry {seq + len(index) // INDEX_RECORD}")
                    raise _Bad(seq, "the index is shorter than the ledger")
                done: list[list[bytes]] = [[] for _ in range(64)]  # completed nodes, per level
                # The lines' ends, computed in C: offset + the running sum of (length + 1).
                ends = list(accumulate(map(_PLUS_ONE, map(len, lines)), initial=offset))[1:]
                whole = len(lines) == stop - seq
                if not (whole and walk.bulk(seq, lines, index, ends, done)):
                    following = reader.peek() if stop < size else b""
                    walk.one_by_one(seq, lines, index, done, following)
                    walk.derived.ends(seq, index, ends)
                if not whole:
                    raise _Bad(
                        seq + len(lines),
                        f"the entries file ends before entry {seq + len(lines)} "
                        f"(the index holds {size}): entries from there on are missing",
                    )
                if ends:
                    offset = ends[-1]
                walk.derived.nodes(tree, seq, done)
                seq = stop
        root = _fold(walk.stack)
        root_hex = root.hex()
        if walk.pack is not None:
            from daemon.ledger.packjob import audit_table

            walk.settle(wait=True)
            walk.derived.problems += audit_table(bodies, walk.pack.result())
    except _Bad as bad:
        walk.settle(wait=True)  # what the chunks before the fault found about bodies
        return VerifyReport(
            ok=False,
            size=size,
            root=root_hex,
            first_bad_seq=bad.seq,
            reason=bad.reason,
            redacted=walk.seen.redacted,
            tampered=walk.seen.tampered,
            derived=walk.derived.listed(),
        )
    finally:
        if walk.pack is not None:
            walk.pack.close()
    seen, derived = walk.seen, walk.derived
    redacted, tampered = seen.redacted, seen.tampered
    unwitnessed = [h for h in redacted if h not in seen.witnessed]
    if unwitnessed:
        tampered.extend(unwitnessed)
        redacted = [h for h in redacted if h in seen.witnessed]
        first = min(seen.redacted_at[h] for h in unwitnessed)
        if walk.first_tampered is None or first < walk.first_tampered:
            walk.first_tampered = first
    why = {h: CHANGED if h in seen.changed else MISSING for h in tampered}
    reason = TAMPERED_BODIES if tampered else None
    if derived.problems and not tampered:
        reason = DERIVED
    return VerifyReport(
        ok=not tampered and not derived.problems,
        size=size,
        root=root_hex,
        first_bad_seq=walk.first_tampered,
        reason=reason,
        redacted=redacted,
        tampered=tampered,
        tampered_why=why,
        derived=derived.listed(),
    )


@dataclass(slots=True)
class _Named:
    """The bodies a chunk names, checked in bulk, waiting for the pack scan (`_Walk.settle`)."""

    seq: int  # the chunk's first entry
    names: bytes  # body digests as hex, in entry order, joined: one object per chunk
    seqs: list[int] | None  # each name's entry (None: every entry of the chunk has a body)
    redactions: set[int]  # entries of kind `redaction` (they witness the body they name)


@dataclass(slots=True)
class _Seen:
    """What deep verify has found so far about bodies."""

    redacted: list[str] = field(default_factory=list)
    tampered: list[str] = field(default_factory=list)
    witnessed: set[str] = field(default_factory=set)  # bodies named by a `redaction` entry
    redacted_at: dict[str, int] = field(default_factory=dict)  # the first entry naming each
    changed: set[str] = field(default_factory=set)  # tampered, (altered) bytes still stored


class _Walk:
    """The state of one verify: the Merkle frontier, the last link, what deep verify found."""

    def __init__(self, bodies: BodyStore, deep: bool, pinned: tuple[int, bytes] | None) -> None:
        self.bodies = bodies
        self.deep = deep
        self.pinned = pinned
        self.stack: list[tuple[int, bytes]] = []
        self.prev = GENESIS_PREV.encode()
        self.seen = _Seen()
        self.first_tampered: int | None = None
        self.derived = _Derived()
        self.pack: PackJob | None = None
        self.named: list[_Named] = []  # chunks whose bodies await the pack scan, in order

    def one_by_one(
        self,
        seq: int,
        lines: list[bytes],
        index: bytes,
        done: list[list[bytes]],
        following: bytes = b"",
    ) -> None:
        """The reference walk: every check on every entry, in order; raises at the first fault.
        `following`: the line after the chunk, if any (its link vouches for the chunk's last)."""
        stack, prev, pinned = self.stack, self.prev, self.pinned
        pin = pinned[0] - seq if pinned is not None else -1
        self.settle(wait=True)  # bodies are judged in entry order
        for i, line in enumerate(lines):
            h = sha256(b"\x00" + line).digest()
            at = line.find(_PREV)
            if at < 0 or line[at + 8 : at + 72] != prev:
                raise _Bad(seq + i, _link_reason(line, seq + i))
            rec = i * INDEX_RECORD
            if index[rec : rec + 32] != h:
                # The index is a cache; the record's own witnesses are the next entry's link,
                # and for the last one a checkpoint at its size (checked just below).
                after = lines[i + 1] if i + 1 < len(lines) else following
                at = after.find(_PREV)
                linked = at >= 0 and after[at + 8 : at + 72] == h.hex().encode()
                if not linked and not (i + 1 == pin and not after):
                    raise _Bad(seq + i, "entry bytes do not match the recorded leaf hash")
                witness = f"entry {seq + i + 1} links to" if linked else "the checkpoint holds"
                wrong_leaf = (
                    f"index.bin: the leaf hash of entry {seq + i} does not match the entry "
                    f"({witness} the entry as it is)"
                )
            else:
                wrong_leaf = ""
            if self.deep:
                self._check_deep(seq + i, line)
            prev = self.prev = h.hex().encode()
            # Inline Frontier.push: this loop is the verify throughput.
            level = 0
            while stack and stack[-1][0] == level:
                h = sha256(b"\x01" + stack.pop()[1] + h).digest()
                level += 1
                done[level].append(h)
            stack.append((level, h))
            if i + 1 == pin and pinned is not None and _fold(stack) != pinned[1]:
                raise _Bad(seq + i, "root differs from the checkpoint at this size")
            if wrong_leaf:
                self.derived.add(wrong_leaf)

    def bulk(
        self, seq: int, lines: list[bytes], index: bytes, ends: list[int], done: list[list[bytes]]
    ) -> bool:
        """Check a whole chunk at once; True if all of it is right (then the walk has moved past
        it), False if anything is off or unsure (then nothing has changed)."""
        if not lines:
            return True
        form = None
        if self.deep:
            from daemon.ledger.lineform import FormCheck

            form = FormCheck(seq, lines)  # overlaps the hashing below
        hashes = [sha256(b"\x00" + line).digest() for line in lines]
        # Links: every line's `prev` slice, joined, against the previous leaves' hex, joined.
        ats = list(map(bytes.find, lines, repeat(_PREV)))
        if -1 in ats:
            return False
        links = b"".join([line[at + 8 : at + 72] for line, at in zip(lines, ats, strict=True)])
        if links != self.prev + hexlify(b"".join(hashes[:-1])):
            return False
        if b"".join(map(_RECORD.pack, hashes, ends)) != index:
            return False  # a leaf hash or an end offset differs: the reference walk says which
        levels = _levels(hashes)
        pinned = self.pinned
        pin = pinned[0] - seq if pinned is not None else -1
        if pinned is not None and 0 < pin <= len(lines):
            at_pin = list(self.stack)
            _push_prefix(at_pin, levels, pin, None)
            if _fold(at_pin) != pinned[1]:
                return False
        named = self._bulk_deep(seq, lines, form) if form is not None else None
        if form is not None and named is None:
            return False
        for level in range(1, len(levels)):
            done[level] = levels[level]
        _push_prefix(self.stack, levels, len(lines), done)
        self.prev = hashes[-1].hex().encode()
        if named is not None:
            self.named.append(named)
            self.settle(wait=False)
        return True

    def _bulk_deep(self, seq: int, lines: list[bytes], form: FormCheck) -> _Named | None:
        """Canonical form, field types and seqs of a whole chunk, and the bodies it names (to
        be held against the pack scan by `settle`); None if unsure (then walk it)."""
        from daemon.ledger.lineform import REDACTION

        ats = list(map(bytes.find, lines, repeat(_BODY)))
        ok, redaction = form.result()
        if not ok:
            return None
        # The lines are canonical, so each find found the key itself (or none: a null body).
        names = b"".join(
            [line[at + 8 : at + 72] for line, at in zip(lines, ats, strict=True) if at >= 0]
        )
        seqs = [seq + i for i, at in enumerate(ats) if at >= 0] if -1 in ats else None
        redactions: set[int] = set()
        for i, line in enumerate(lines if redaction else []):
            if REDACTION in line:
                try:
                    entry = Entry.from_line(line)
                except ValueError:
                    return None  # the pattern let through what the parser refuses: walk it
                if entry.kind == "redaction":
                    redactions.add(seq + i)
        return _Named(seq, names, seqs, redactions)

    def settle(self, wait: bool) -> None:
        """Judge the bodies of the chunks checked so far against the pack scan, in entry order:
        at once if the scan is done, else only when `wait`. An intact body needs no more; the
        others, and every body a `redaction` entry names, are judged one by one."""
        if not self.named or self.pack is None or not (wait or self.pack.ready()):
            return
        found = self.pack.result()
        for named in self.named:
            if not named.redactions and found.follows(named.names):
                continue
            if named.names:
                found.resync(named.names[-64:], within=2 * len(named.names))
            intact = found.intact()
            names = [named.names[i : i + 64] for i in range(0, len(named.names), 64)]
            if not named.redactions and intact.issuperset(names):
                continue
            seqs = (
                named.seqs if named.seqs is not None else range(named.seq, named.seq + len(names))
            )
            for at_seq, name in zip(seqs, names, strict=True):
                witness = at_seq in named.redactions
                if witness or name not in intact:
                    self._judge(at_seq, name.decode(), witness)
        self.named.clear()

    def _check_deep(self, seq: int, line: bytes) -> None:
        try:
            entry = Entry.from_line(line)
        except ValueError as err:
            raise _Bad(seq, f"entry does not parse as a canonical entry: {err}") from err
        if entry.seq != seq:
            raise _Bad(seq, f"entry says seq {entry.seq}")
        if entry.body is not None:
            self._judge(seq, entry.body, entry.kind == "redaction")

    def _judge(self, seq: int, body: str, witness: bool) -> None:
        """Whether entry `seq`'s body is intact, redacted or tampered; a `redaction` entry
        (`witness`) also names the body it redacted."""
        if not witness and self.pack is not None and body.encode() in self.pack.result().intact():
            return
        seen = self.seen
        digest = bytes.fromhex(body)
        data, is_redacted = self.bodies.read(digest)
        bad = False
        if is_redacted:
            if body not in seen.redacted:
                seen.redacted.append(body)
                seen.redacted_at[body] = seq
        elif data is None or hashlib.sha256(data).digest() != digest:
            bad = True
            if body not in seen.tampered:
                seen.tampered.append(body)
            if data is not None:
                seen.changed.add(body)
        if witness and data is not None:
            target = json.loads(data).get("redacted") if data.startswith(b"{") else None
            if isinstance(target, str):
                seen.witnessed.add(target)
        if bad and self.first_tampered is None:
            self.first_tampered = seq


def _levels(hashes: list[bytes]) -> list[list[bytes]]:
    """The chunk's complete aligned subtrees, a level at a time: levels[k][j] covers leaves
    [j * 2**k, (j + 1) * 2**k) of the chunk (chunks start at multiples of CHUNK_ENTRIES)."""
    levels = [hashes]
    level = hashes
    while len(level) > 1:
        pairs = iter(level)
        level = [sha256(b"\x01" + a + b).digest() for a, b in zip(pairs, pairs, strict=False)]
        levels.append(level)
    return levels


def _push_prefix(
    stack: list[tuple[int, bytes]],
    levels: list[list[bytes]],
    count: int,
    done: list[list[bytes]] | None,
) -> None:
    """Push the first `count` leaves of a chunk onto the frontier, as maximal subtrees."""
    start = 0
    for k in range(len(levels) - 1, -1, -1):
        if not count >> k & 1:
            continue
        h, level = levels[k][start >> k], k
        while stack and stack[-1][0] == level:
            h = sha256(b"\x01" + stack.pop()[1] + h).digest()
            level += 1
            if done is not None:
                done[level].append(h)
        stack.append((level, h))
        start += 1 << k


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
        self.rest: list[bytes] = []  # the pieces of a line not ended yet
        self.ready: list[bytes] = []
        self.at = 0

    def peek(self) -> bytes:
        """The next complete line, left to be taken (b"" at the end of the file)."""
        line = self.take(1)
        if not line:
            return b""
        self.at -= 1  # `take` just read it from `ready`
        return line[0]

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
            self.rest.append(block)
            if b"\n" not in block:
                continue  # a line longer than a block: joined once it ends, not per block
            self.ready = b"".join(self.rest).split(b"\n")
            self.rest = [self.ready.pop()]
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


@dataclass(slots=True)
class Chain:
    """What `walk_chain` found: the leaf hash and end offset of every line that chains, and
    where the chain broke (`bad`, with why, and the link the bad line names, if it has one)."""

    leaves: list[bytes]
    ends: list[int]
    bad: int | None = None
    reason: str = ""
    named_prev: bytes | None = None


def walk_chain(fd: int, count: int, size: int) -> Chain:
    """The first `count` lines of the entries file (below byte `size`), each held to its seq
    and its link to the line before, in file order: no index, no parse (the canonical slices,
    as the fast verify reads them). Stops at the first that does not chain."""
    chain = Chain([], [])
    prev, offset, seq, rest = GENESIS_PREV.encode(), 0, 0, b""
    while seq < count:
        want = min(READ_BYTES, size - offset - len(rest))
        block = os.pread(fd, want, offset + len(rest)) if fd >= 0 and want > 0 else b""
        if not block:
            chain.bad = seq
            chain.reason = (
                f"entry {seq} is torn: the entries file ends inside it"
                if rest
                else f"entries from seq {seq} on are missing: the entries file ends there"
            )
            return chain
        lines = (rest + block).split(b"\n")
        rest = lines.pop()
        for line in lines:
            at = line.find(_PREV)
            named = line[at + 8 : at + 72] if at >= 0 else None
            if named != prev or line.find(b'"seq":%d,' % seq) < 0:
                chain.bad, chain.named_prev = seq, named
                chain.reason = _link_reason(line, seq) if named != prev else f"not entry {seq}"
                return chain
            leaf = sha256(b"\x00" + line).digest()
            offset += len(line) + 1
            chain.leaves.append(leaf)
            chain.ends.append(offset)
            prev = leaf.hex().encode()
            seq += 1
            if seq == count:
                return chain
    return chain


def _gap(seq: int, found: int) -> str:
    missing = f"entry {seq} is" if found == seq + 1 else f"entries {seq}..{found - 1} are"
    return f"{missing} missing (the next line holds seq {found})"
