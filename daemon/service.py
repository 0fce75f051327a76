"""The Daemon: owns the ledger, the roster, the slot pool, the router and the runs engine.

`start()` opens the ledger (which recovers a torn tail), loads the roster, creates the pool
(lazy: no model server starts before the first lease), and reconciles — every run the ledger
shows in flight becomes `interrupted`, witnessed, so nothing is left "running" that is not.
`stop()` lets runs drain for `settings.drain_s`, interrupts the rest (resumable), stops the
pool and writes a checkpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

from daemon.config import Settings
from daemon.ledger import Ledger
from daemon.routing import Router
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
        self.interrupted_on_start: list[str] = []

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
            self.interrupted_on_start = await self._engine.restore()
        except BaseException:
            await self._ledger.close()
            raise
        self._checkpoints = asyncio.create_task(self._checkpoint_loop(), name="checkpoints")

    async def reload_roster(self, path: Path | None = None) -> Roster:
        """Load the roster again; on any problem raise RosterError and keep the last good one."""
        roster = load_roster(path or self.roster_path)
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
        if self._checkpoints is not None:
            self._checkpoints.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._checkpoints
        if self._engine is not None:
            await self._engine.shutdown(self.settings.drain_s)
        if self._pool is not None:
            await self._pool.stop()
        if self._ledger is not None:
            await self._ledger.checkpoint()
            await self._ledger.close()
            self._ledger = None

    async def _on_slot_event(self, event: SlotEvent) -> None:
        if self._ledger is None:
            return
        body = event.model_dump(mode="json")
        await self._ledger.append(actor="pool", kind=event.kind, body=body)

    async def _checkpoint_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.checkpoint_interval_s)
            try:
                await self.ledger.checkpoint()
            except Exception:  # a failed checkpoint is logged; the next one retries
                log.exception("checkpoint failed")
