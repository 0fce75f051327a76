"""Ledger errors. All are `TallyError`s so surfaces can map them generically."""

from __future__ import annotations

from daemon.errors import Conflict, TallyError, Unavailable


class LedgerLocked(Conflict):
    """Another process holds the state dir's ledger lock."""

    code = "ledger_locked"

    def __init__(self, path: str, pid: int | None) -> None:
        holder = f"pid {pid}" if pid is not None else "an unknown process"
        super().__init__(
            f"the ledger in {path} is locked by {holder} (is another tally daemon running?)",
            details={"path": path, "pid": pid},
        )
        self.pid = pid


class LedgerCorrupt(TallyError):
    """The stored entries are damaged somewhere other than a torn tail; refuse to go on."""

    code = "ledger_corrupt"
    status = 500

    def __init__(self, seq: int, reason: str) -> None:
        super().__init__(
            f"ledger corrupt at seq {seq}: {reason}", details={"seq": seq, "reason": reason}
        )
        self.seq = seq
        self.reason = reason


class CheckpointUnwritable(Unavailable):
    """A checkpoint could not be written (e.g. a full disk); the entries are untouched."""

    code = "checkpoint_unwritable"


class LedgerFailed(Unavailable):
    """A write or fsync failed: the ledger stopped accepting appends until a restart."""

    code = "ledger_failed"
