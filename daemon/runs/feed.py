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
An `agent.step` goes to listeners with its texts cut (`live_data`): the ledger has it whole.

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

from daemon import record as rec
from daemon.runs.agent.record import step_event
from daemon.runs.ports import EntryLike
from daemon.runs.state import RunEvent

log = logging.getLogger(__name__)

LISTENER_LIMIT = 4096
"""Events queued for one listener before it is dropped as too slow."""
OVERRUN = "overrun"
"""The kind of the event that ends a dropped listener's stream."""
WRITING_CAP = 64 * 1024
"""Characters of one streaming call's text kept for listeners that arrive late."""

Watcher = Callable[[EntryLike, rec.Body], None]
"""Sees each run entry the engine witnesses (seq, ts, kind, run, parent) with its body, as the
model of its kind the engine witnessed (`daemon.record`): typed, and never parsed again."""


def live_data(kind: str, body: Any) -> Any:
    """An entry's body as listeners get it: whole, but for an `agent.step`, whose texts are
    cut (`record.step_event`: a step may carry a file's content and a test run's output)."""
    return step_event(body) if kind == "agent.step" else body


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
        self._writing: dict[str, dict[str | None, list[str]]] = {}
        """run → task (None: not a task's) → the pieces its streaming call wrote so far."""
        self._written: dict[tuple[str, str | None], int] = {}
        self._calls: dict[tuple[str, int], str | None] = {}
        """(run, model.call seq) → its task, while the call streams."""
        self._nudged: list[Callable[[str], None]] = []

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

    def publish(self, run_id: str, entry: EntryLike, typed: rec.Body, body: dict[str, Any]) -> None:
        """`entry` (the run's) is witnessed: tell every watcher (its model, `typed`) and
        listener (its body as written, `body`)."""
        kind = typed.KIND
        for watcher in self._watchers:
            try:
                watcher(entry, typed)
            except Exception:  # an observer's fault must never fail the run it observes
                log.exception("a run watcher failed on %s", kind)
        self._track(run_id, entry, typed)
        listeners = self._listeners.get(run_id)
        if listeners:
            event = RunEvent(seq=entry.seq, kind=kind, data=live_data(kind, body))
            for queue in listeners:
                queue.offer(event)

    def nudge(self, nudged: Callable[[str], None]) -> Callable[[], None]:
        """Call `nudged(run_id)` when a run's live state changes without an entry (a wait for a
        slot begins or ends); returns the function that stops it."""
        self._nudged.append(nudged)
        return lambda: self._nudged.remove(nudged) if nudged in self._nudged else None

    def waiting(self, run_id: str, task: str | None, waiting: bool) -> None:
        """A task (None: the run) began or ended a wait for a slot: a `waiting` event for the
        run's listeners (not an entry: no seq), and a nudge for whoever lists runs."""
        for queue in self._listeners.get(run_id, ()):
            queue.offer(RunEvent(seq=None, kind="waiting", data={"task": task, "waiting": waiting}))
        for nudged in self._nudged:
            try:
                nudged(run_id)
            except Exception:  # an observer's fault must never fail the run it observes
                log.exception("a run nudge failed")

    def delta(self, run_id: str, text: str, task: str | None = None) -> None:
        """A streamed token: `task` names the chat task it belongs to (None: synthesis)."""
        tasks = self._writing.get(run_id)
        if tasks is not None and task in tasks:
            size = self._written.get((run_id, task), 0)
            if size + len(text) <= WRITING_CAP:
                tasks[task].append(text)
                self._written[(run_id, task)] = size + len(text)
        for queue in self._listeners.get(run_id, ()):
            queue.offer(RunEvent(seq=None, kind="delta", data={"text": text, "task": task}))

    def writing(self, run_id: str) -> list[RunEvent]:
        """What each call of the run streaming now has written so far, one `delta` per task."""
        return [
            RunEvent(seq=None, kind="delta", data={"text": "".join(pieces), "task": task})
            for task, pieces in self._writing.get(run_id, {}).items()
            if pieces
        ]

    def _track(self, run_id: str, entry: EntryLike, body: rec.Body) -> None:
        """Keep the text of the run's streaming calls: from model.call to its model.reply."""
        if isinstance(body, rec.RunState | rec.RunInterrupted):
            for task in self._writing.pop(run_id, {}):
                self._written.pop((run_id, task), None)
            for call in [c for c in self._calls if c[0] == run_id]:
                del self._calls[call]
            return
        if isinstance(body, rec.ModelCall):
            task = body.task
            if body.request.get("stream") is True:  # the request as sent (a JSON object)
                self._calls[(run_id, entry.seq)] = task
                self._writing.setdefault(run_id, {})[task] = []
                self._written.pop((run_id, task), None)
        elif isinstance(body, rec.ModelReply) and entry.parent is not None:
            if (run_id, entry.parent) not in self._calls:
                return
            task = self._calls.pop((run_id, entry.parent))
            tasks = self._writing.get(run_id, {})
            tasks.pop(task, None)
            self._written.pop((run_id, task), None)
            if not tasks:
                self._writing.pop(run_id, None)
