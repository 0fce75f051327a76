"""Reads and proofs: get, body, read_bodies, entries, causal_chain, verify, proofs.

Contract. Reads leave the event loop: every read that touches a file runs in a worker thread, a
batch in one hop (`read_body` is the blocking form). Reads see exactly the acknowledged entries
(`_size`), from the record files: a batch's bytes are written to them (page cache) before it
is acknowledged, so a read never waits for a catch-up (see the durability invariant in
`writer`). A body is read back with its state
(`Body`), so null, missing, tampered and redacted are told apart. The body store's lock covers
memory and preads only: the writer grows the table and fsyncs outside it.

Proofs are never served unchecked: the writer keeps a snapshot of its frontier (`_head`) after
every batch; every proof is checked against the root it implies before it is served (the leaf
re-hashed from the entry line), and a mismatch rebuilds the stored nodes once (logged) or
refuses the proof with `LedgerCorrupt`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

from pydantic import BaseModel

from daemon import layout
from daemon.errors import NotFound
from daemon.ledger.audit import (
    DERIVED,
    TAMPERED_BODIES,
    VerifyReport,
    verify_files,
    walk_chain,
)
from daemon.ledger.canonical import canonical_bytes
from daemon.ledger.entry import (
    NO_BODY,
    Body,
    Entry,
)
from daemon.ledger.errors import LedgerCorrupt
from daemon.ledger.handle import Handle
from daemon.ledger.merkle import (
    EMPTY_ROOT,
    Frontier,
    Subtree,
    consistency_path,
    inclusion_path,
    leaf_hash,
    root_from_inclusion,
    verify_consistency,
)
from daemon.ledger.store import INDEX_END, body_digest

log = logging.getLogger(__name__)

EMPTY_HEX = EMPTY_ROOT.hex()


_Proof = TypeVar("_Proof", "InclusionProof", "ConsistencyProof")


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


class _Mismatch(Exception):
    """A proof built from the stored tree did not verify against the trusted root."""


class Reader(Handle):
    """The reading side of `Ledger` (module doc)."""

    async def get(self, seq: int) -> Entry:
        if not 0 <= seq < self._size:
            raise NotFound(f"no ledger entry {seq} (size {self._size})")
        return await asyncio.to_thread(self._read_entry, seq)

    def read_body(self, body_hash: str | None) -> Body:
        """The body with its state (see `Body`). Blocking: a read, a SHA-256 and a JSON
        parse; on the event loop use `body` or `read_bodies`, which run it in a thread."""
        return self._bodies_of([body_hash])[0]

    def _bodies_of(self, hashes: Sequence[str | None]) -> list[Body]:
        """Blocking: the bodies, in order, from one `_stored_bodies` read of the storage."""
        digests: list[bytes | None] = []
        for h in hashes:
            try:
                digests.append(None if h is None else bytes.fromhex(h))
            except ValueError:
                digests.append(None)
        stored = self._stored_bodies([d for d in digests if d is not None])
        out: list[Body] = []
        for h, digest in zip(hashes, digests, strict=True):
            if h is None:
                out.append(NO_BODY)
            elif digest is None:
                out.append(Body("missing"))
            else:
                data, redacted = stored.get(digest, (None, False))
                out.append(body_state(digest, data, redacted))
        return out

    def _stored_bodies(self, digests: list[bytes]) -> dict[bytes, tuple[bytes | None, bool]]:
        """Storage (worker thread): (bytes, redacted) of each body the record holds; bytes
        None when redacted; a body it does not hold is left out."""
        return {d: self.bodies.read(d) for d in digests}

    async def body(self, body_hash: str | None) -> Body:
        """One body with its state, read in a worker thread."""
        return await asyncio.to_thread(self.read_body, body_hash)

    async def read_bodies(self, hashes: Sequence[str | None]) -> list[Body]:
        """Many bodies in one worker-thread hop, in order (a batch of entries' bodies)."""
        if not any(hashes):
            return [NO_BODY] * len(hashes)
        return await asyncio.to_thread(self._bodies_of, hashes)

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
        wanted = EntryFilter(kind, run, actor, in_run)
        return await asyncio.to_thread(self._scan, max(start, 0), size, limit, wanted)

    def _scan(self, start: int, size: int, limit: int, wanted: EntryFilter) -> list[Entry]:
        """Storage (worker thread): the entries in [start, size) that `wanted` keeps, at
        most `limit`. Here: blocks of 4,096 lines; with a filter, `bytes.find` jumps from one
        line holding the first needle to the next (in C), so a run's few entries among many
        cost little Python, and many readers at once do not starve the event loop of the GIL."""
        needles, shunned = wanted.needles(), wanted.shunned()
        found: list[Entry] = []
        seq = start
        while seq < size and len(found) < limit:
            stop = min(size, seq + 4096)
            a, b = self.tree.end(seq - 1), self.tree.end(stop - 1)
            block = os.pread(self._entries_fd, b - a, a)
            for line in _lines_with(block, needles):
                if not any(n in line for n in shunned):
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
            verify_files, self.dir / layout.ENTRIES, self.tree, self.bodies, size, deep, pinned
        )
        report = self._as_opened(report)
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

    @property
    def record_note(self) -> str | None:
        """A reader's: how the record files stood against the journal, if that is to be said
        (files behind it or differing from it; a damaged journal; an unacknowledged batch)."""
        agreement = self._agreement
        if not self.readonly or agreement is None or not agreement.reason:
            return None
        if agreement.state == "behind":
            return f"{agreement.reason}; {self._restore_hint()}"
        return agreement.reason

    def _restore_hint(self) -> str:
        return (
            f"start the daemon on {self.state_dir} to restore them (its open does; this "
            "read-only check changed nothing)"
        )

    def _as_opened(self, report: VerifyReport) -> VerifyReport:
        """A reader's report, with what its open found: record files behind the journal or
        differing from it (the first seq either way, unless the walk found an earlier fault),
        a tree that does not add up to the checkpoint, and warnings."""
        if not self.readonly:  # the owner acted on it at its open
            return report
        agreement, faults = self._agreement, []
        warnings = list(report.warnings)
        if agreement is not None and agreement.reason:
            if agreement.state == "behind":
                faults.append((agreement.seq, f"{agreement.reason}; {self._restore_hint()}"))
            elif agreement.state == "differs":
                faults.append((agreement.seq, f"{agreement.reason} (nothing was changed)"))
            else:
                warnings.append(agreement.reason)
        broken = report.first_bad_seq is not None and report.reason != TAMPERED_BODIES
        if self._unanchored is not None and broken:  # else the walk added them up to it itself
            faults.append((self._unanchored.seq, self._unanchored.reason))
        if self._checkpoint_gone is not None:
            faults.append((None, self._checkpoint_gone))
        for seq, reason in faults:
            at = report.size if seq is None else seq
            if report.first_bad_seq is not None and report.first_bad_seq <= at:
                warnings.append(reason)  # an earlier fault (or a tampered body) comes first
                report = report.model_copy(update={"ok": False})
                continue
            report = report.model_copy(update={"ok": False, "first_bad_seq": at, "reason": reason})
        derived = report.derived
        if self._index_note is not None:
            derived = [self._index_note, *derived]
            if report.ok or report.reason is None:
                report = report.model_copy(update={"ok": False, "reason": DERIVED})
        return report.model_copy(update={"warnings": warnings, "derived": derived})

    def _rebuild(self, problems: list[str]) -> list[str]:
        """Writer thread: rebuild the caches `verify` found wrong (index records, tree nodes,
        the body table) from the entries."""
        rebuilt = []
        index = any(p.startswith(layout.INDEX) for p in problems) and self._rebuild_index()
        if index:
            rebuilt.append(layout.INDEX)
        if (index or any(p.startswith("tree/") for p in problems)) and self._rebuild_tree():
            rebuilt.append("tree/level-*.bin")
        if any(p.startswith(layout.BODIES_TABLE) for p in problems):
            self.bodies.rebuild_table()
            rebuilt.append(layout.BODIES_TABLE)
        return rebuilt

    def root(self, size: int | None = None) -> str:
        """The stored tree's root at `size` (proofs use `_trusted_root`, which checks it).
        Blocking: it reads the stored nodes."""
        size = self._size if size is None else size
        if not 0 <= size <= self._size:
            raise NotFound(f"tree size {size} is beyond the ledger's size {self._size}")
        return self._subtree_for(lambda sub: sub(0, size))(0, size).hex() if size else EMPTY_HEX

    def leaf_hash(self, seq: int) -> str:
        return self._subtree_for(lambda sub: sub(seq, seq + 1))(seq, seq + 1).hex()

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

    def _subtree_for(self, plan: Callable[[Subtree], object]) -> Subtree:
        """Storage (worker thread): the subtree hashes a proof reads. `plan` makes the proof's
        reads on a recorder first, so a storage across a network can fetch all of its nodes in
        one round trip; the file storage's nodes are local reads (`Tree.subtree`)."""
        return self.tree.subtree

    def _record_leaf(self, seq: int) -> bytes:
        """Storage (worker thread): the leaf hash of entry `seq`, re-hashed from its line."""
        start, end = self.tree.span(seq)
        return leaf_hash(os.pread(self._entries_fd, end - start - 1, start))

    def _inclusion(self, seq: int, size: int) -> InclusionProof:
        head = self._head[0]
        subtree = self._subtree_for(
            lambda sub: (inclusion_path(seq, size, sub), _root_reads(size, head, sub))
        )
        path = inclusion_path(seq, size, subtree)
        root = self._trusted_root(size, subtree)
        if root_from_inclusion(seq, size, self._record_leaf(seq), path) != root:
            raise _Mismatch(f"an inclusion proof of seq {seq} in {size} did not verify")
        return InclusionProof(
            leaf_index=seq, tree_size=size, root=root.hex(), path=[p.hex() for p in path]
        )

    def _consistency(self, old: int, new: int) -> ConsistencyProof:
        head = self._head[0]
        subtree = self._subtree_for(
            lambda sub: (
                consistency_path(old, new, sub),
                _root_reads(new, head, sub),
                sub(0, old) if old else None,
            )
        )
        path = consistency_path(old, new, subtree)
        new_root = self._trusted_root(new, subtree)
        old_root = subtree(0, old) if old else EMPTY_ROOT
        if not verify_consistency(old, new, old_root, new_root, path):
            raise _Mismatch(f"a consistency proof from {old} to {new} did not verify")
        return ConsistencyProof(
            old_size=old,
            new_size=new,
            old_root=old_root.hex(),
            new_root=new_root.hex(),
            path=[p.hex() for p in path],
        )

    def _trusted_root(self, size: int, subtree: Subtree) -> bytes:
        """The root at `size`, vouched for by the writer's frontier (`_head`): read from the
        stored nodes, then proven consistent with the head's root. Raises `_Mismatch`."""
        head = self._head
        head_root = Frontier.restore(head).root()
        if size == head[0]:
            return head_root
        root = subtree(0, size) if size else EMPTY_ROOT
        path = consistency_path(size, head[0], subtree)
        if not verify_consistency(size, head[0], root, head_root, path):
            raise _Mismatch(f"the stored root at size {size} is not consistent with the head")
        return root

    async def _checked(self, build: Callable[[], _Proof], seq: int) -> _Proof:
        """Serve `build()`'s proof if it checks; else rebuild the stored tree once and retry;
        else refuse (a wrong proof is never served). Built in a worker thread: O(log n) preads
        and hashes, each of which may wait for the disk."""
        if self._unanchored is not None:  # a reader whose tree does not add up: no proof
            raise self._unanchored
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

    def _rebuild_index(self) -> int:
        """Writer thread (no batch runs meanwhile): correct, in place, every index record that
        differs from the entries walked on their own; nothing if they do not chain (then the
        entries are what is wrong, and `verify` said where). Readers may be reading: records
        are patched where they are, never cut and rewritten."""
        tree = self.tree
        size = tree.size
        chain = walk_chain(self._entries_fd, size, os.fstat(self._entries_fd).st_size)
        if chain.bad is not None or len(chain.leaves) != size:
            return 0
        fixed = 0
        for i, (leaf, end) in enumerate(zip(chain.leaves, chain.ends, strict=True)):
            record = leaf + INDEX_END.pack(end)
            if tree.index.read(i) != record:
                tree.index.patch(i, record)
                fixed += 1
        return fixed

    def _rebuild_tree(self) -> int:
        fixed, frontier = self.tree.recheck(0)
        if frontier.snapshot() != self._head:
            log.error("ledger: the leaf hashes do not add up to the head: see `ledger verify`")
        return len(fixed)


def _lines_with(block: bytes, needles: list[bytes]) -> Iterator[bytes]:
    """The lines of `block` (whole lines, each ending in a newline) holding every needle, in
    order. A needle is a canonical `"key":value,` fragment: in a canonical line a quote inside
    a string is escaped, so it can only match the key itself."""
    if not needles:
        yield from block.split(b"\n")[:-1]
        return
    first, rest = needles[0], needles[1:]
    at = block.find(first)
    while at >= 0:
        begin = block.rfind(b"\n", 0, at) + 1
        end = block.find(b"\n", at)
        if end < 0:  # not a whole line: the block ends early (it never does; stop rather than loop)
            return
        line = block[begin:end]
        if all(n in line for n in rest):
            yield line
        at = block.find(first, end)


def _root_reads(size: int, head: int, sub: Subtree) -> object:
    """The reads `_trusted_root(size)` makes (for `_subtree_for`'s plan)."""
    if size == head:
        return None
    return (sub(0, size) if size else None, consistency_path(size, head, sub))


@dataclass(frozen=True, slots=True)
class EntryFilter:
    """What `entries` keeps: all the given fields equal, and with `in_run` only entries of
    some run. One meaning, rendered by each storage: needles in canonical lines for files
    (`needles`, `shunned`), a WHERE clause for the shared record."""

    kind: str | None = None
    run: str | None = None
    actor: str | None = None
    in_run: bool = False

    def fields(self) -> list[tuple[str, str]]:
        return [
            (k, v)
            for k, v in (("kind", self.kind), ("run", self.run), ("actor", self.actor))
            if v is not None
        ]

    def needles(self) -> list[bytes]:
        """Canonical `"key":value,` fragments every kept line holds."""
        return [
            f'"{key}":'.encode() + canonical_bytes(value) + b"," for key, value in self.fields()
        ]

    def shunned(self) -> list[bytes]:
        """Fragments no kept line holds."""
        return [b'"run":null,'] if self.in_run else []


def body_state(digest: bytes, data: bytes | None, redacted: bool) -> Body:
    """A stored body (as a storage returns it) with its state: redacted, missing, tampered
    (its bytes do not hash to its digest) or present."""
    if redacted:
        return Body("redacted")
    if data is None:
        return Body("missing")
    if body_digest(data) != digest:
        return Body("tampered")
    return Body("present", json.loads(data))
