"""The kinds the record writes of itself: a daemon joining a shared record, and cosigning.

`ledger.join` (actor "ledger") is written once per daemon into a shared (PostgreSQL) record
when it first registers its checkpoint key. `checkpoint.cosign` and `checkpoint.inconsistent`
are a cosigner's: the caller's client name is the actor. None has a run or a parent.
"""

from __future__ import annotations

from typing import ClassVar

from daemon.record.body import CLIENT, Body


class LedgerJoin(Body):
    """A daemon joined a shared record: its name and the checkpoint key its entries are
    signed under (`vkey`, a signed-note verifier key)."""

    KIND: ClassVar[str] = "ledger.join"
    ACTORS: ClassVar[tuple[str, ...]] = ("ledger",)

    daemon: str
    vkey: str


class CheckpointCosign(Body):
    """This daemon cosigned `origin`'s checkpoint at `size` (C2SP tlog-cosignature), having
    checked its signature under the member's pinned key and its consistency with the last one
    it cosigned. `note` is the origin's signed note (its own line only), `cosigner` the name
    of our key, `time` the cosignature's timestamp (Unix seconds)."""

    KIND: ClassVar[str] = "checkpoint.cosign"
    ACTORS: ClassVar[tuple[str, ...]] = (CLIENT,)

    origin: str
    member: str
    size: int
    root: str
    note: str
    cosigner: str
    time: int


class CheckpointInconsistent(Body):
    """This daemon refused to cosign a checkpoint not proven consistent with the one it
    cosigned before (`cosigned_*`); `proven_fork`: two signed roots for one size, the proof
    of a fork. Written once per refused checkpoint."""

    KIND: ClassVar[str] = "checkpoint.inconsistent"
    ACTORS: ClassVar[tuple[str, ...]] = (CLIENT,)

    origin: str
    member: str
    size: int
    root: str
    note: str
    cosigned_size: int
    cosigned_root: str
    cosigned_note: str
    proven_fork: bool
    reason: str
