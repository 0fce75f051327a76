"""Write failures the ledger survives: what they are, and how it finds the disk usable again.

A failed write or fsync (a full disk, a quota, an I/O error) rolls the batch back to what was
acknowledged (see the durability invariant in `daemon.ledger.writer`) and opens an `Outage`: while
it lasts, appends and checkpoints fail fast with `LedgerUnwritable` (HTTP 503 + Retry-After),
and a probe retries with a bounded backoff. The probe finishes an unfinished rollback, writes and
fsyncs a scratch file, and syncs the derived files; once all of that succeeds, the outage ends
and appends resume with no restart.
"""

from __future__ import annotations

import contextlib
import errno
import os
import time
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel

from daemon.ledger.errors import LedgerUnwritable
from daemon.ledger.store import write_all

PROBE_BYTES = 64 * 1024  # a probe asks the disk for this much room, written and fsynced
PROBE_FIRST = 0.25  # seconds before the first probe; doubling after each failure
PROBE_MAX = 5.0
PROBE_FILE = ".probe"

REASONS = {
    errno.ENOSPC: "disk_full",
    errno.EDQUOT: "quota",
    errno.EIO: "io_error",
    errno.EROFS: "read_only",
    errno.EFBIG: "file_too_large",
}


class Unreachable(OSError):
    """A storage on the network (the shared record's database) did not answer, or lost the
    connection: an outage like a full disk, with its own reason code."""

    REASON = "database_unreachable"


def classify(err: OSError) -> tuple[str, str]:
    """(reason, detail): a stable reason code for clients and metrics, and a readable detail."""
    if isinstance(err, Unreachable):
        return Unreachable.REASON, str(err)
    reason = REASONS.get(err.errno or 0, "os_error")
    name = errno.errorcode.get(err.errno or 0, "")
    detail = f"{err.strerror or err}" + (f" ({name})" if name else "")
    return reason, detail


@dataclass(frozen=True, slots=True)
class Mark:
    """What was acknowledged when a batch began: the sizes a failed batch is rolled back to."""

    size: int
    entries_end: int
    pack_size: int
    journal_end: int


@dataclass(slots=True)
class Outage:
    reason: str
    detail: str
    since: float
    rollback: Mark | None
    """A rollback that failed too (its truncate or fsync): the probe finishes it first."""
    delay: float = PROBE_FIRST
    failures: int = 1

    @classmethod
    def of(cls, err: OSError, rollback: Mark | None = None) -> Outage:
        reason, detail = classify(err)
        return cls(reason, detail, time.monotonic(), rollback)

    def again(self, err: OSError) -> None:
        """A probe failed: keep the outage, back off."""
        self.reason, self.detail = classify(err)
        self.failures += 1
        self.delay = min(self.delay * 2, PROBE_MAX)

    def error(self, what: str = "this append was not acknowledged") -> LedgerUnwritable:
        return LedgerUnwritable(self.reason, self.detail, retry_after=self.delay, what=what)


class LedgerHealth(BaseModel):
    """For `health`, `/healthz` and `/metrics`: can the ledger write right now?"""

    writable: bool
    reason: str | None = None
    detail: str | None = None
    since_s: float | None = None
    write_failures: int = 0
    """Write or fsync failures since the daemon started (outages and failed probes)."""


def probe(directory: Path) -> None:
    """Write and fsync `PROBE_BYTES` in `directory`, then remove them; raises OSError."""
    path = directory / PROBE_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            write_all(fd, bytes(PROBE_BYTES))
            os.fsync(fd)
        finally:
            os.close(fd)
    finally:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
