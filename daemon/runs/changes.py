"""Which runs changed, in order: the log behind the run feed (the `run_feed` tool, the console).

Every change of a run (an entry witnessed for it, or a wait for a slot beginning or ending, which
writes no entry) gives it the next tick of this log; a run keeps only its latest tick, so a
reader that remembers the tick it last saw asks for the runs changed since then and gets each
once, however often it changed meanwhile. A cursor is `EPOCH.TICK`, the epoch drawn when the
daemon starts: a cursor of another daemon (or of this one before a restart), or one older than
what the log still holds (it keeps the latest KEEP runs), cannot be answered and says so, so
the reader lists the runs afresh instead of missing changes.

Readers that push the feed (the console's SSE stream) wait for `changed`: it wakes them once
per FLUSH_S at most, so a busy run costs a stream one batch per tick, not one per entry.
"""

from __future__ import annotations

import asyncio
import re
import secrets

from daemon.runs.feed import Feed
from daemon.runs.ports import EntryLike

KEEP = 10_000
"""Runs whose latest tick the log holds; a cursor older than the oldest of them is reset."""
FLUSH_S = 0.2
"""Changes are coalesced this long before readers waiting for them wake."""
CURSOR = r"[0-9a-f]{8}\.[0-9]{1,15}"


class RunChanges:
    def __init__(self, feed: Feed, keep: int = KEEP) -> None:
        self.epoch = secrets.token_hex(4)
        self.tick = 0
        self.keep = keep
        self._latest: dict[str, int] = {}
        """run -> the tick of its latest change, oldest first."""
        self._forgotten = 0
        """The tick of the latest change dropped to keep `keep` runs: older cursors reset."""
        self._flushed = 0
        self._woken = asyncio.Event()
        self._timer: asyncio.TimerHandle | None = None
        feed.watch(self._entry)  # for the engine's life: the log is its own
        feed.nudge(self.change)

    def _entry(self, entry: EntryLike, body: object) -> None:  # any entry of a run: a change
        if entry.run is not None:
            self.change(str(entry.run))

    def change(self, run_id: str) -> None:
        self.tick += 1
        self._latest.pop(run_id, None)
        self._latest[run_id] = self.tick
        if len(self._latest) > self.keep:
            self._forgotten = self._latest.pop(next(iter(self._latest)))
        if self._timer is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a synchronous caller): nobody can be waiting
            self._flushed = self.tick
            return
        self._timer = loop.call_later(FLUSH_S, self._flush)

    def _flush(self) -> None:
        self._timer = None
        self._flushed = self.tick
        woken, self._woken = self._woken, asyncio.Event()
        woken.set()

    def cursor(self, tick: int | None = None) -> str:
        return f"{self.epoch}.{self.tick if tick is None else tick}"

    def tick_of(self, cursor: str | None) -> int | None:
        """The tick a cursor names, or None if this log cannot answer from it (none given,
        another daemon's, from the future, or older than what the log still holds)."""
        if cursor is None or not re.fullmatch(CURSOR, cursor):
            return None
        epoch, _, tick = cursor.partition(".")
        after = int(tick)
        if epoch != self.epoch or after > self.tick or after < self._forgotten:
            return None
        return after

    def since(self, after: int) -> list[tuple[str, int]]:
        """The runs changed after tick `after`, each once with its latest tick, oldest first."""
        found = []
        for run_id, tick in reversed(self._latest.items()):
            if tick <= after:
                break
            found.append((run_id, tick))
        found.reverse()
        return found

    async def changed(self, after: int, timeout: float) -> bool:
        """Wait up to `timeout` s for a change after tick `after` to be flushed."""
        if self._flushed > after:
            return True
        woken = self._woken
        try:
            await asyncio.wait_for(woken.wait(), timeout)
        except TimeoutError:
            return False
        return True
