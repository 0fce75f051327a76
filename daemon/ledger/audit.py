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
from dataclasses import dataclass
from hashlib import sha256
from pathlib import Path

from pydantic import BaseModel

from daemon.ledger.entry import GENESIS_PREV, Entry
from daemon.ledger.merkle import EMPTY_ROOT, node_hash
from daemon.ledger.store import INDEX_RECORD, BodyStore, Tree

CHUNK_ENTRIES = 65536
_PREV = b'"prev":"'


class VerifyReport(BaseModel):
    ok: bool
    size: int
    root: str
    first_bad_seq: int | None = None
    reason: str | None = None
    redacted: list[str] = []
    tampered: list[str] = []
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
    """Re-hash entries [0, size) and compare with the stored tree (and a pinned (size, root))."""
    stack: list[tuple[int, bytes]] = []
    redacted: list[str] = []
    tampered: list[str] = []
    witnessed: set[str] = set()
    changed: set[str] = set()  # tampered bodies whose (altered) bytes are still there
    first_tampered: int | None = None
    root_hex = ""
    try:
        with open(entries_path, "rb", buffering=0) as f:
            prev = GENESIS_PREV.encode()
            seq = 0
            offset = 0
            while seq < size:
                stop = min(size, seq + CHUNK_ENTRIES)
                index = tree.index.read_range(seq, stop)
                end = int.from_bytes(index[-8:], "little")
                data = os.pread(f.fileno(), end - offset, offset)
                lines = data.split(b"\n")
                if len(lines) != stop - seq + 1 or lines[-1]:
                    raise _Bad(seq, "entry lines do not match the index's offsets")
                pin = pinned[0] - seq if pinned is not None else -1
                for i, line in enumerate(lines[:-1]):
                    h = sha256(b"\x00" + line).digest()
                    at = line.find(_PREV)
                    if at < 0 or line[at + 8 : at + 72] != prev:
                        raise _Bad(seq + i, "prev does not link to the previous entry")
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
                    stack.append((level, h))
                    if i + 1 == pin and pinned is not None and _fold(stack) != pinned[1]:
                        raise _Bad(seq + i, "root differs from the checkpoint at this size")
                offset = end
                seq = stop
        root = _fold(stack)
        root_hex = root.hex()
        _check_levels(tree, size)
        if size and tree.subtree(0, size) != root:
            raise _Bad(size - 1, "stored Merkle tree does not match the entries")
    except _Bad as bad:
        return VerifyReport(
            ok=False,
            size=size,
            root=root_hex,
            first_bad_seq=bad.seq,
            reason=bad.reason,
            redacted=redacted,
            tampered=tampered,
        )
    unwitnessed = [h for h in redacted if h not in witnessed]
    if unwitnessed:
        tampered.extend(unwitnessed)
        redacted = [h for h in redacted if h in witnessed]
    why = {h: CHANGED if h in changed else MISSING for h in tampered}
    return VerifyReport(
        ok=not tampered,
        size=size,
        root=root_hex,
        first_bad_seq=first_tampered,
        reason="tampered bodies" if tampered else None,
        redacted=redacted,
        tampered=tampered,
        tampered_why=why,
    )


def _check_levels(tree: Tree, size: int) -> None:
    """Every cached interior node must be the hash of its two children (the leaves are
    already checked against the entry lines), level by level in bulk reads: a damaged
    `tree/level-*.bin` is named here even where the root does not use it."""
    level, count = 1, size // 2
    while count and level < len(tree.levels):
        child = tree.levels[level - 1]
        width = INDEX_RECORD if level == 1 else 32
        for start in range(0, count, CHUNK_ENTRIES):
            stop = min(count, start + CHUNK_ENTRIES)
            kids = child.read_range(2 * start, 2 * stop)
            nodes = tree.levels[level].read_range(start, stop)
            for i in range(stop - start):
                a = 2 * i * width
                left, right = kids[a : a + 32], kids[a + width : a + width + 32]
                if sha256(b"\x01" + left + right).digest() != nodes[32 * i : 32 * i + 32]:
                    first = (start + i) << level
                    raise _Bad(first, f"cached Merkle tree level {level} node {start + i} is wrong")
        level, count = level + 1, count // 2


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
