"""The storage interface: what the one writer and the one reader need from where a record is kept.

The ledger's own code exists once, above this seam: the group commit (`writer.WriterThread`,
`Writer._commit_batch`, `_settle`), the canonical lines (`writer.encode_batch`), outages and
their probe loop, the checks of appends and redactions (`writer`), body states, entry filters,
causal chains and the proofs, checked against the writer's frontier before they are served
(`reader`), checkpoints on a timer and the owner's key (`log`). Below it, a storage provides
the operations of `Storage`, each on the thread the contract names:
- the writer thread (one batch or job at a time): `_commit` a batch of appends at the head it
  holds, atomically and durably, or raise `writer._Stalled` (nothing acknowledged; an outage
  begins) or `LedgerFailed`; `_probe` until it takes writes again; `_checkpoint` (sign the
  head, keep the note). Each moves `_head` (the frontier snapshot proofs are checked against)
  only after what it covers is durable.
- worker threads (reads, never past `_size`): `_read_entry`, `_stored_bodies` (bytes and the
  redacted flag; the reader tells present, missing, tampered and redacted apart), `_scan` (the
  entries an `EntryFilter` keeps), `_subtree_for` (the stored Merkle nodes a proof reads, all
  at once where a round trip costs), `_record_leaf` (a leaf re-hashed from the line),
  `_has_body`, `_rebuild_tree` (after a proof that did not check).
- the loop: `_after_redaction` (what follows a committed `redaction` entry), `verify`,
  `close`, `abandon`.

Two implementations: the file storage (the state dir's `entries.jsonl`, `bodies.pack`, journal
and derived files: `log.Ledger` with `recovery`, the file halves of `writer` and `reader`, and
`store`), the embedded default; and PostgreSQL (`shared.SharedLedger`, tables in `postgres`),
a record several daemons share. Both keep the same canonical bytes, leaf hashes and notes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from daemon.ledger.audit import VerifyReport
    from daemon.ledger.checkpoint import Checkpoint
    from daemon.ledger.entry import Entry
    from daemon.ledger.merkle import Subtree
    from daemon.ledger.outage import Outage
    from daemon.ledger.reader import EntryFilter
    from daemon.ledger.writer import _Pending


class Storage(Protocol):
    """The operations a record's storage provides to the ledger above it (module doc)."""

    # writer thread
    def _commit(self, batch: list[_Pending]) -> list[Entry]: ...
    def _probe(self, outage: Outage) -> None: ...
    def _checkpoint(self) -> Checkpoint: ...

    # worker threads
    def _read_entry(self, seq: int) -> Entry: ...
    def _stored_bodies(self, digests: list[bytes]) -> dict[bytes, tuple[bytes | None, bool]]: ...
    def _scan(self, start: int, size: int, limit: int, wanted: EntryFilter) -> list[Entry]: ...
    def _subtree_for(self, plan: Callable[[Subtree], object]) -> Subtree: ...
    def _record_leaf(self, seq: int) -> bytes: ...
    def _has_body(self, digest: bytes) -> bool: ...
    def _rebuild_tree(self) -> int: ...

    # the loop
    async def _after_redaction(self, entry: Entry, digest: bytes) -> None: ...
    async def verify(self, deep: bool = False) -> VerifyReport: ...
    async def close(self) -> None: ...
    async def abandon(self) -> None: ...
