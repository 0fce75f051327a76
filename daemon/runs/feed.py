"""The live feed of run entries: watchers (metrics, traces, the console) and run listeners (SSE).

After the engine witnesses an entry, `publish` calls every watcher with it and puts a
`RunEvent` on the queue of every listener of its run; `delta` puts a streamed token on the
listeners' queues only (tokens are not entries). An observer's fault never fails the run it
observes: a watcher that raises is logged and skipped.

A listener's queue is bounded (`limit`, LISTENER_LIMIT events): one that falls that far behind
(a client reading its SSE stream slowly while a run streams tokens) is dropped — its queue is
emptied and holds one `overrun` event, and nothing more is queued for it — so a slow reader
costs the daemon a bounded amount of memory. Its stream ends with that event; the client
resumes from the ledger with Last-Event-ID (the tokens it missed are in the run's answer).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from daemon.runs.ports import EntryLike
from daemon.runs.state import RunEvent

log = logging.getLogger(__name__)

LISTENER_LIMIT = 4096
"""Events queued for one listener before it is dropped as too slow."""
OVERRUN = "overrun"
"""The kind of the event that ends a dropped listener's stream."""

Watcher = Callable[[EntryLike, dict[str, Any]], None]
"""Sees each run entry the engine witnesses (seq, ts, kind, run, parent) with its body."""


class Listener(asyncio.Queue[RunEvent]):
    """One listener's queue: `offer` puts an event, or drops the listener once it is full."""

    def __init__(self, run_id: str, limit: int) -> None:
        super().__init__()
        self.run_id = run_id
        self.limit = limit
        self.overrun = False

    def offer(self, event: RunEvent) -> None:
        if self.overrun:
            return
        if self.qsize() < self.limit:
            self.put_nowait(event)
            return
        self.overrun = True
        while not self.empty():
            self.get_nowait()
        log.warning("dropped a listener of run %s: %d events behind", self.run_id, self.limit)
        reason = (
            f"this stream fell {self.limit} events behind the run and was dropped; "
            "reconnect with Last-Event-ID to resume from the ledger"
        )
        self.put_nowait(RunEvent(seq=None, kind=OVERRUN, data={"reason": reason}))


class Feed:
    def __init__(self, limit: int = LISTENER_LIMIT) -> None:
        self._watchers: list[Watcher] = []
        self._listeners: dict[str, set[Listener]] = {}
        self.limit = limit
        """Events queued per listener before it is dropped (see the module docstring)."""

    def watch(self, watcher: Watcher) -> Callable[[], None]:
        """Call `watcher(entry, body)` after every entry the engine witnesses; returns the
        function that stops it."""
        self._watchers.append(watcher)
        return lambda: self._watchers.remove(watcher) if watcher in self._watchers else None

    @contextmanager
    def listen(self, run_id: str) -> Iterator[Listener]:
        """A queue of the run's events from now on, for as long as the block lasts; it ends
        with an `overrun` event if its reader falls `limit` events behind."""
        queue = Listener(run_id, self.limit)
        self._listeners.setdefault(run_id, set()).add(queue)
        try:
            yield queue
        finally:
            listeners = self._listeners.get(run_id)
            if listeners is not None:
                listeners.discard(queue)
                if not listeners:
                    del self._listeners[run_id]

    def publish(self, run_id: str, kind: str, entry: EntryLike, body: dict[str, Any]) -> None:
        """`entry` (the run's, of this kind) is witnessed: tell every watcher and listener."""
        for watcher in self._watchers:
            try:
                watcher(entry, body)
            except Exception:  # an observer's fault must never fail the run it observes
                log.exception("a run watcher failed on %s", kind)
        listeners = self._listeners.get(run_id)
        if listeners:
            event = RunEvent(seq=entry.seq, kind=kind, data=body)
            for queue in listeners:
                queue.offer(event)

    def delta(self, run_id: str, text: str, task: str | None = None) -> None:
        """A streamed token: `task` names the chat task it belongs to (None: synthesis)."""
        for queue in self._listeners.get(run_id, ()):
            queue.offer(RunEvent(seq=None, kind="delta", data={"text": text, "task": task}))
