"""The Daemon: owns the ledger, the roster, the slot pool, the router and the runs engine.

`start()` opens the ledger (which recovers a torn tail), loads the roster, creates the pool
(lazy: no model server starts before the first lease), and reconciles — every run the ledger
shows in flight becomes `interrupted`, witnessed, so nothing is left "running" that is not.
`stop()` lets runs drain for `settings.drain_s`, interrupts the rest (resumable), stops the
pool and writes a checkpoint.

Start-up is bounded by the run-state snapshot (`daemon.runs.snapshot`): written after start,
every `snapshot_interval_s` and on stop, it lets `start()` replay only the entries after it;
without a valid one, start-up replays the whole ledger (the result is the same).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from pathlib import Path

from daemon.config import Settings
from daemon.errors import TallyError
from daemon.ledger import Ledger, LedgerUnwritable
from daemon.routing import Router
from daemon.runs import snapshot as snapshots
from daemon.runs.engine import Engine, EngineOptions
from daemon.slots import Pool, SlotEvent
from roster.loading import default_roster_path, load_roster
from roster.models import Roster

log = logging.getLogger(__name__)


class Daemon:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._ledger: Ledger | None = None
        self._pool: Pool | None = None
        self._engine: Engine | None = None
        self._roster: Roster | None = None
        self._router: Router | None = None
        self._checkpoints: asyncio.Task[None] | None = None
        self._snapshots: asyncio.Task[None] | None = None
        self._snapshot_size = -1
        self.interrupted_on_start: list[str] = []
        self.restored_from: int | None = None
        """The ledger size the start-up snapshot covered (None: the whole ledger was replayed)."""
        self.start_seconds = 0.0

    # The parts exist only between start() and stop(); asking earlier is a programming error.
    @property
    def ledger(self) -> Ledger:
        assert self._ledger is not None, "Daemon.start() first"
        return self._ledger

    @property
    def pool(self) -> Pool:
        assert self._pool is not None, "Daemon.start() first"
        return self._pool

    @property
    def engine(self) -> Engine:
        assert self._engine is not None, "Daemon.start() first"
        return self._engine

    @property
    def roster(self) -> Roster:
        assert self._roster is not None, "Daemon.start() first"
        return self._roster

    @property
    def router(self) -> Router:
        assert self._router is not None, "Daemon.start() first"
        return self._router

    @property
    def roster_path(self) -> Path:
        return self.settings.roster_path or default_roster_path()

    async def start(self) -> None:
        settings = self.settings
        started = time.perf_counter()
        settings.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        roster = load_roster(self.roster_path)  # a bad roster at start is fatal: nothing to keep
        self._ledger = await Ledger.open(settings.state_dir)
        try:
            self._roster = roster
            self._router = Router(roster)
            self._pool = Pool(roster, settings.state_dir, on_event=self._on_slot_event)
            await self._pool.start()
            self._engine = Engine(
                self._ledger,
                self._pool,
                roster,
                self._router,
                options=EngineOptions(
                    max_tasks=settings.max_tasks,
                    coordinator=settings.coordinator,
                    judge=settings.judge,
                ),
            )
            base = snapshots.load(settings.state_dir, self._ledger)
            self.interrupted_on_start = await self._engine.restore(base)
            self.restored_from = self._engine.restored_from
            if self.restored_from is not None:
                self._snapshot_size = self.restored_from
            await self.write_snapshot()
        except BaseException:
            await self._ledger.close()
            raise
        self._checkpoints = asyncio.create_task(self._checkpoint_loop(), name="checkpoints")
        self._snapshots = asyncio.create_task(self._snapshot_loop(), name="run snapshots")
        self.start_seconds = time.perf_counter() - started

    async def write_snapshot(self, patience_s: float = 0.5) -> bool:
        """Write the run-state snapshot if the ledger grew since the last one.

        It waits up to `patience_s` for an instant with no run entry in flight (see
        Engine.snapshot); under constant load it gives up and the next period tries again.
        """
        deadline = time.monotonic() + patience_s
        while (taken := self.engine.snapshot()) is None:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.005)
        size, views = taken
        if size == self._snapshot_size:
            return True
        # Serialized now, before any await: the views are the live ones.
        data = snapshots.encode(snapshots.stamp(self.ledger, size, views))
        await asyncio.to_thread(snapshots.save, self.settings.state_dir, data)
        self._snapshot_size = size
        return True

    async def reload_roster(self, path: Path | None = None) -> Roster:
        """Load the roster again; on any problem raise RosterError and keep the last good one."""
        # Off the loop: the path may come from a client, and a large or slow file would stall it.
        roster = await asyncio.to_thread(load_roster, path or self.roster_path)
        self._roster = roster
        self._router = Router(roster)
        self.engine.router = self._router
        self.engine.set_roster(roster)
        await self.pool.reload(roster)
        await self.ledger.append(
            actor="daemon",
            kind="roster.reload",
            body={"lanes": len(roster.lanes), "models": [m.name for m in roster.models]},
        )
        return roster

    async def stop(self) -> None:
        for loop in (self._checkpoints, self._snapshots):
            if loop is not None:
                loop.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await loop
        if self._engine is not None:
            await self._engine.shutdown(self.settings.drain_s)
        if self._pool is not None:
            # Before the snapshot: stopping servers witnesses slot.stopped entries, and a
            # snapshot that covers the whole ledger makes the next start replay nothing.
            await self._pool.stop()
        if self._engine is not None and self._ledger is not None:
            try:
                await self.write_snapshot(patience_s=5.0)
            except Exception:  # derived data: the next start replays the ledger instead
                log.exception("run snapshot failed")
        if self._ledger is not None:
            try:
                await self._ledger.checkpoint()
            except TallyError as err:  # e.g. a full disk: close still releases the ledger
                log.warning("final checkpoint failed: %s", err.message)
            await self._ledger.close()
            self._ledger = None

    async def _on_slot_event(self, event: SlotEvent) -> None:
        if self._ledger is None:
            return
        body = event.model_dump(mode="json")
        await self._ledger.append(actor="pool", kind=event.kind, body=body)

    async def _snapshot_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.snapshot_interval_s)
            try:
                await self.write_snapshot()
            except Exception:  # derived data: logged, the next period retries
                log.exception("run snapshot failed")

    async def _checkpoint_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.checkpoint_interval_s)
            try:
                await self.ledger.checkpoint()
            except LedgerUnwritable as err:  # a full disk: one line, not a traceback a minute
                log.warning("checkpoint failed: %s", err.message)
            except Exception:  # a failed checkpoint is logged; the next one retries
                log.exception("checkpoint failed")
