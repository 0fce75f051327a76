"""The ledger: an append-only JSONL log with group commit, recovery, proofs and checkpoints.

`Ledger` is the facade importers use; its parts live beside it, one concept each, sharing the
state declared (with who may change what) in `handle`:
- `recovery`: what open guarantees (torn tail, missing-body tail, tree re-check, redactions);
- `writer`: group commit, rollback and outages, redaction; it states the durability invariant;
- `reader`: reads and proofs;
- here: the lifecycle (open, close, abandon) and checkpoints.
The storage operations these parts call (commit a batch, read lines, bodies and nodes, probe,
checkpoint) form the `storage.Storage` interface: here they are the file storage's; the shared
record on PostgreSQL (`shared`) provides them over its tables under the same writer and reader.
Self-contained parts: `journal` (the write-ahead journal), `store` (file formats), `audit`
(verify), `outage`, `checkpoint`, `summary` (aggregates over the record).

Layout of `<state>/ledger/`: `entries.jsonl` (the record: one canonical entry per line),
`bodies.pack` (content-addressed bodies), `wal` (the journal: see `journal`), derived files
(see `store`), `meta.json`,
`checkpoint` (the latest signed note), `checkpoint.key` / `checkpoint.vkey`, `lock`.

An append is acknowledged only once it and its body are durable: see the durability invariant
in `writer`. A checkpoint signs only acknowledged entries, after the derived files are synced.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import os
import time
from pathlib import Path

from daemon import layout
from daemon.ledger.agreement import Agreement
from daemon.ledger.checkpoint import (
    Checkpoint,
    CheckpointError,
    SignerOnDemand,
    save_checkpoint,
    verify_message,
)
from daemon.ledger.entry import GENESIS_PREV
from daemon.ledger.errors import LedgerCorrupt, LedgerFailed, LedgerUnwritable, SignerUnusable
from daemon.ledger.outage import Outage
from daemon.ledger.reader import ConsistencyProof, InclusionProof, Reader
from daemon.ledger.recovery import TAIL_CHECK, Recovery
from daemon.ledger.store import (
    BodyStore,
    Tree,
)
from daemon.ledger.writer import SYNC_EVERY, LedgerStats, Writer, WriterThread, _Stats, check_append

log = logging.getLogger(__name__)


__all__ = [
    "SYNC_EVERY",
    "TAIL_CHECK",
    "ConsistencyProof",
    "InclusionProof",
    "Ledger",
    "LedgerStats",
    "check_append",
]


class Ledger(Recovery, Writer, Reader):
    """Open with `await Ledger.open(state_dir)`; see the module doc for the on-disk contract."""

    def __init__(self, state_dir: Path, readonly: bool, tail_check: int = TAIL_CHECK) -> None:
        self.state_dir = state_dir
        self._tail_check = tail_check
        self.dir = state_dir / layout.LEDGER
        self.readonly = readonly
        self._lock_fd = -1
        self._entries_fd = -1
        self._entries_end = 0
        self._size = 0  # committed and acknowledged-visible
        self._last_hash = GENESIS_PREV
        self._last_ts = 0
        self._synced = 0
        self._failed: LedgerFailed | None = None  # a bug mid-commit: nothing safe to resume
        self._outage: Outage | None = None  # the disk refused a write: probing for its return
        self._prober: asyncio.Task[None] | None = None
        self._write_failures = 0
        self._closed = False
        self._stats = _Stats()
        self._latest: Checkpoint | None = None
        self._signer: SignerOnDemand | None = None
        self._vkey: str | None = None
        self._executor = WriterThread(self._commit_batch)
        self._halted: Outage | None = None
        self._broken: LedgerFailed | None = None
        self._unapplied: dict[int, bytes] = {}  # redaction seq -> body not yet zeroed
        # The writer's frontier after its last batch (vouched for at open): proofs are checked
        # against the root it implies. A snapshot, swapped whole, so readers never see a torn one.
        self._head: tuple[int, tuple[tuple[int, bytes], ...]] = (0, ())
        self._repaired = False  # the stored tree is rebuilt at most once per open
        self._agreement: Agreement | None = None
        self._entries_limit: int | None = None
        self._unanchored: LedgerCorrupt | None = None
        self._checkpoint_gone: str | None = None
        self._index_note: str | None = None
        self._ticker: asyncio.Task[None] | None = None
        self.tree: Tree
        self.bodies: BodyStore

    @classmethod
    async def open(
        cls,
        state_dir: Path | str,
        readonly: bool = False,
        *,
        checkpoint_interval: float | None = 60.0,
        tail_check: int = TAIL_CHECK,
    ) -> Ledger:
        """Recover and (unless read-only) lock.

        `tail_check`: how many of the last indexed entries are re-hashed against their leaf
        hashes. Corruption further back is not detected here (open must not re-read the
        history; see TAIL_CHECK): `verify()` finds it.
        """
        ledger = cls(Path(state_dir), readonly, tail_check)
        ledger._loop = asyncio.get_running_loop()
        try:
            await ledger._loop.run_in_executor(ledger._executor, ledger._open)
        except BaseException:
            ledger._release()
            ledger._executor.shutdown()
            raise
        if not readonly and checkpoint_interval:
            ledger._ticker = asyncio.create_task(
                ledger._tick(checkpoint_interval), name="ledger-checkpoints"
            )
        return ledger

    @property
    def vkey(self) -> str | None:
        """The checkpoint verifier key (C2SP vkey string), if the ledger has one. The owner's
        first call loads the signer (see `load_signer`)."""
        if self._signer is not None:
            return self._signer.get().vkey
        return self._vkey

    def seal(self, message: bytes) -> tuple[bytes, bytes]:
        """The owner's: (MAC, ed25519 signature) of `message`, for derived data it writes and
        must trust again (the run snapshot). The MAC is for the owner's own check at its next
        start (`check_mac`: no signature library loads); the signature for anyone holding the
        public key (`check_signature`: `tally ledger verify`). Blocking (the first use loads
        the key): call it off the loop."""
        if self._signer is None:
            raise LedgerFailed("only the ledger's owner seals")
        mac = hmac.new(self._signer.mac_key, message, hashlib.sha256).digest()
        return mac, self._signer.get().sign_message(message)

    def check_mac(self, message: bytes, mac: bytes) -> bool:
        """The owner's: whether `mac` is its seal's MAC of `message` (False for a reader)."""
        if self._signer is None:
            return False
        want = hmac.new(self._signer.mac_key, message, hashlib.sha256).digest()
        return hmac.compare_digest(want, mac)

    def check_signature(self, message: bytes, signature: bytes) -> bool:
        """Whether `signature` is the checkpoint key's signature of `message` (by
        `checkpoint.vkey`, or the owner's key); False with no key to check it with."""
        vkey = self.vkey
        if vkey is None:
            return False
        try:
            return verify_message(vkey, message, signature)
        except (CheckpointError, ValueError):
            return False

    def load_signer(self) -> None:
        """Load the owner's signing key now (it loads at first use otherwise): the daemon's
        warm-up calls it off the loop, after the start."""
        if self._signer is not None:
            self._signer.get()

    def latest_checkpoint(self) -> Checkpoint | None:
        return self._latest

    async def checkpoint(self) -> Checkpoint:
        """Sign and persist a checkpoint of everything committed so far."""
        if self.readonly or self._signer is None:
            raise LedgerFailed("checkpoints are written by the ledger's owner only")
        if self._failed is not None:
            raise self._failed
        if self._outage is not None:
            raise self._outage.error(what="no checkpoint was written")
        loop = asyncio.get_running_loop()
        try:
            checkpoint = await loop.run_in_executor(self._executor, self._checkpoint)
        except OSError as err:
            self._write_failures += 1
            outage = Outage.of(err)
            self._begin_outage(outage)
            raise outage.error(what="no checkpoint was written") from err
        self._latest = checkpoint
        return checkpoint

    def _checkpoint(self) -> Checkpoint:
        assert self._signer is not None
        if self._failed is not None:
            raise self._failed
        self._sync_derived()
        checkpoint = self._signer.get().sign(
            self.tree.size, self.tree.root(), max(time.time_ns() // 1000, self._last_ts)
        )
        save_checkpoint(self.dir / layout.CHECKPOINT, checkpoint)
        # meta.json names the checkpoint just saved, so a deleted or older checkpoint file is
        # seen by a reader (recovery: `_checkpoint_gone`); nothing new to sync but the meta
        self._latest = checkpoint
        self._sync_derived()
        return checkpoint

    async def _tick(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            latest = self._latest
            healthy = self._failed is None and self._outage is None
            if healthy and (latest is None or latest.size != self._size):
                try:
                    await self.checkpoint()
                except LedgerUnwritable as err:
                    log.warning("ledger: periodic checkpoint skipped: %s", err.message)
                except Exception:
                    log.exception("ledger: periodic checkpoint failed")

    async def close(self) -> None:
        """Finish queued appends, checkpoint, sync the derived files, release the lock."""
        if self._closed:
            return
        self._closed = True
        for task in (self._ticker, self._prober):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        # Appends queued before now are committed (and settled) before any job queued below.
        loop = asyncio.get_running_loop()
        try:
            if not self.readonly and self._failed is None:
                await self._close_outage(loop)
            if not self.readonly and self._failed is None and self._outage is None:
                latest = self._latest
                try:
                    if latest is None or latest.size != self._size:
                        self._latest = await loop.run_in_executor(self._executor, self._checkpoint)
                    else:
                        await loop.run_in_executor(self._executor, self._sync_derived)
                except (LedgerFailed, SignerUnusable, OSError) as err:
                    log.warning("ledger: closing without a final checkpoint: %s", err)
        finally:
            await loop.run_in_executor(self._executor, self._release)
            self._executor.shutdown(wait=True)

    async def _close_outage(self, loop: asyncio.AbstractEventLoop) -> None:
        """One last probe, so a disk that came back lets close checkpoint as usual."""
        outage = self._outage
        if outage is None:
            return
        try:
            await loop.run_in_executor(self._executor, self._probe, outage)
        except OSError as err:
            log.warning("ledger: closing while the disk still refuses writes (%s)", err)
            return
        self._outage = None

    async def abandon(self) -> None:
        """Drop the handle as a crash would (no checkpoint, no derived sync); for tests."""
        self._closed = True
        for task in (self._ticker, self._prober):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        await asyncio.get_running_loop().run_in_executor(self._executor, self._release)
        self._executor.shutdown(wait=True)

    def _release(self) -> None:
        with contextlib.suppress(AttributeError):
            self.tree.close()
        with contextlib.suppress(AttributeError):
            self.bodies.close()
        with contextlib.suppress(AttributeError):
            self._journal.close()
        for fd in (self._entries_fd, self._lock_fd):
            if fd >= 0:
                os.close(fd)
        self._entries_fd = self._lock_fd = -1

    async def __aenter__(self) -> Ledger:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
