"""The live feed of run entries: watchers (metrics, traces, the console) and run listeners (SSE).

After the engine witnesses an entry, `publish` calls every watcher with it and puts a
`RunEvent` on the queue of every listener of its run; `delta` puts a streamed token on the
listeners' queues only (tokens are not entries). An observer's fault never fails the run it
observes: a watcher that raises is logged and skipped.
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

Watcher = Callable[[EntryLike, dict[str, Any]], None]
"""Sees each run entry the engine witnesses (seq, ts, kind, run, parent) with its body."""


class Feed:
    def __init__(self) -> None:
        self._watchers: list[Watcher] = []
        self._listeners: dict[str, set[asyncio.Queue[RunEvent]]] = {}
        self._nudged: list[Callable[[str], None]] = []

    def watch(self, watcher: Watcher) -> Callable[[], None]:
        """Call `watcher(entry, body)` after every entry the engine witnesses; returns the
        function that stops it."""
        self._watchers.append(watcher)
        return lambda: self._watchers.remove(watcher) if watcher in self._watchers else None

    @contextmanager
    def listen(self, run_id: str) -> Iterator[asyncio.Queue[RunEvent]]:
        """A queue of the run's events from now on, for as long as the block lasts."""
        queue: asyncio.Queue[RunEvent] = asyncio.Queue()
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
                queue.put_nowait(event)

    def nudge(self, nudged: Callable[[str], None]) -> Callable[[], None]:
        """Call `nudged(run_id)` when a run's live state changes without an entry (a wait for a
        slot begins or ends); returns the function that stops it."""
        self._nudged.append(nudged)
        return lambda: self._nudged.remove(nudged) if nudged in self._nudged else None

    def waiting(self, run_id: str, task: str | None, waiting: bool) -> None:
        """A task (None: the run) began or ended a wait for a slot: a `waiting` event for the
        run's listeners (not an entry: no seq), and a nudge for whoever lists runs."""
        for queue in self._listeners.get(run_id, ()):
            queue.put_nowait(
                RunEvent(seq=None, kind="waiting", data={"task": task, "waiting": waiting})
            )
        for nudged in self._nudged:
            try:
                nudged(run_id)
            except Exception:  # an observer's fault must never fail the run it observes
                log.exception("a run nudge failed")

    def delta(self, run_id: str, text: str, task: str | None = None) -> None:
        """A streamed token: `task` names the chat task it belongs to (None: synthesis)."""
        for queue in self._listeners.get(run_id, ()):
            queue.put_nowait(RunEvent(seq=None, kind="delta", data={"text": text, "task": task}))
