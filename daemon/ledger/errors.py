"""Ledger errors. All are `TallyError`s so surfaces can map them generically."""

from __future__ import annotations

import math

from daemon.errors import Busy, Conflict, TallyError, Unavailable


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


class LedgerFailed(Unavailable):
    """A write or fsync failed: the ledger stopped accepting appends until a restart."""

    code = "ledger_failed"


class LedgerUnwritable(Busy):
    """The ledger cannot write right now (a full disk, a quota, an I/O error).

    Appends fail fast with this until a probe finds the disk writable again; nothing it
    refused was acknowledged. `reason` classifies the errno (see `daemon.ledger.outage`).
    """

    code = "ledger_unwritable"

    def __init__(
        self,
        reason: str,
        detail: str,
        retry_after: float,
        what: str = "this append was not acknowledged",
    ) -> None:
        super().__init__(
            f"the ledger cannot write right now ({detail}): {what}; "
            f"retry in {max(1, math.ceil(retry_after))} s",
            retry_after=retry_after,
            details={"reason": reason, "detail": detail},
        )
        self.reason = reason


class SignerUnusable(TallyError):
    """The checkpoint key passed the open's check but does not load: nothing is signed until
    the key is fixed and the daemon restarted; appends go on."""

    code = "checkpoint_key_unusable"
    status = 500
