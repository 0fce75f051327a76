"""The live feed of run entries: watchers (metrics, traces, the console) and run listeners (SSE).

After the engine witnesses an entry, `publish` calls every watcher with it and puts a
`RunEvent` on the queue of every listener of its run; `delta` puts a streamed token on the
listeners' queues only (tokens are not entries). An observer's fault never fails the run it
observes: a watcher that raises is logged and skipped.

A listener that arrives while a call is streaming would miss the text written so far (tokens
are not in the record until the reply is): the feed keeps each streaming call's text, per run
and task, from its `model.call` to its `model.reply` (at most WRITING_CAP characters each),
and `writing` hands it over as one `delta` per task, so `tally run --follow` and a `submit`
whose stream opened a moment late show the text from its start.
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

WRITING_CAP = 64 * 1024
"""Characters of one streaming call's text kept for listeners that arrive late."""

Watcher = Callable[[EntryLike, dict[str, Any]], None]
"""Sees each run entry the engine witnesses (seq, ts, kind, run, parent) with its body."""


class Feed:
    def __init__(self) -> None:
        self._watchers: list[Watcher] = []
        self._listeners: dict[str, set[asyncio.Queue[RunEvent]]] = {}
        self._writing: dict[str, dict[str | None, list[str]]] = {}
        """run → task (None: not a task's) → the pieces its streaming call wrote so far."""
        self._written: dict[tuple[str, str | None], int] = {}
        self._calls: dict[tuple[str, int], str | None] = {}
        """(run, model.call seq) → its task, while the call streams."""

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
        self._track(run_id, kind, entry, body)
        listeners = self._listeners.get(run_id)
        if listeners:
            event = RunEvent(seq=entry.seq, kind=kind, data=body)
            for queue in listeners:
                queue.put_nowait(event)

    def delta(self, run_id: str, text: str, task: str | None = None) -> None:
        """A streamed token: `task` names the chat task it belongs to (None: synthesis)."""
        tasks = self._writing.get(run_id)
        if tasks is not None and task in tasks:
            size = self._written.get((run_id, task), 0)
            if size + len(text) <= WRITING_CAP:
                tasks[task].append(text)
                self._written[(run_id, task)] = size + len(text)
        for queue in self._listeners.get(run_id, ()):
            queue.put_nowait(RunEvent(seq=None, kind="delta", data={"text": text, "task": task}))

    def writing(self, run_id: str) -> list[RunEvent]:
        """What each call of the run streaming now has written so far, one `delta` per task."""
        return [
            RunEvent(seq=None, kind="delta", data={"text": "".join(pieces), "task": task})
            for task, pieces in self._writing.get(run_id, {}).items()
            if pieces
        ]

    def _track(self, run_id: str, kind: str, entry: EntryLike, body: dict[str, Any]) -> None:
        """Keep the text of the run's streaming calls: from model.call to its model.reply."""
        if kind in ("run.state", "run.interrupted"):
            for task in self._writing.pop(run_id, {}):
                self._written.pop((run_id, task), None)
            for call in [c for c in self._calls if c[0] == run_id]:
                del self._calls[call]
            return
        if kind == "model.call":
            task = body.get("task") if isinstance(body.get("task"), str) else None
            request = body.get("request")
            if isinstance(request, dict) and request.get("stream") is True:
                self._calls[(run_id, entry.seq)] = task
                self._writing.setdefault(run_id, {})[task] = []
                self._written.pop((run_id, task), None)
        elif kind == "model.reply" and entry.parent is not None:
            if (run_id, entry.parent) not in self._calls:
                return
            task = self._calls.pop((run_id, entry.parent))
            tasks = self._writing.get(run_id, {})
            tasks.pop(task, None)
            self._written.pop((run_id, task), None)
            if not tasks:
                self._writing.pop(run_id, None)
