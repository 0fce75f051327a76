"""An open ledger's shared state, and which thread may change which part of it.

Contract. `Ledger` (in `log`) is one object assembled from parts that each own one concept:
`recovery` (what open guarantees), `writer` (group commit, rollback, outages, redaction) and
`reader` (reads and proofs). They share the state declared on `Handle`, under one discipline:
- the writer thread (`_executor`) is the only one that changes the files, the tree,
  the body table and `_head`; open (recovery) runs on it too, before the writer task starts;
- the event loop owns `_size` (grown only after a batch is durable, see the durability
  invariant in `writer`), `_outage`, `_failed`, `_closed` and `_latest`;
- readers (worker threads) read the files, the tree and the body store below `_size`, and
  check proofs against `_head`. Both only grow while they read: a rollback removes a batch that
  was never acknowledged, so `_size` never covered it.
"""

from __future__ import annotations

import os
from concurrent.futures import Executor
from pathlib import Path

from daemon.ledger.agreement import Agreement
from daemon.ledger.checkpoint import Checkpoint, SignerOnDemand
from daemon.ledger.entry import Entry
from daemon.ledger.errors import LedgerCorrupt, LedgerFailed
from daemon.ledger.journal import Journal
from daemon.ledger.outage import Outage
from daemon.ledger.store import (
    BodyStore,
    Tree,
)


class Handle:
    """The state the ledger's parts share (module doc: who changes what)."""

    state_dir: Path
    dir: Path
    readonly: bool
    tree: Tree
    bodies: BodyStore
    _tail_check: int
    _lock_fd: int
    _entries_fd: int
    _size: int
    _failed: LedgerFailed | None
    _outage: Outage | None
    _closed: bool
    _executor: Executor  # the writer thread (see `writer.WriterThread`)
    _latest: Checkpoint | None
    _signer: SignerOnDemand | None  # the owner's
    _vkey: str | None  # a read-only opener's, from `checkpoint.vkey`
    _repaired: bool
    _head: tuple[int, tuple[tuple[int, bytes], ...]]
    _unapplied: dict[int, bytes]
    _journal: Journal  # the owner's only
    _agreement: Agreement | None  # how the record files stood against the journal at open
    _entries_limit: int | None  # a reader's: the entries file is read up to here, not past
    _index_note: str | None  # the index did not match the entries and was rebuilt from them
    _unanchored: LedgerCorrupt | None  # a reader's: the tree does not add up to the checkpoint
    _checkpoint_gone: str | None  # the checkpoint file is missing or older than meta.json says

    @property
    def size(self) -> int:
        return self._size

    def _read_entry(self, seq: int) -> Entry:
        start, end = self.tree.span(seq)
        return Entry.from_line(os.pread(self._entries_fd, end - start - 1, start))
