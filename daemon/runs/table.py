"""The run table: every run memory holds, in full or as a summary, and the census over them.

A run's view is the replay reducer (`replay.apply`) applied to its witnessed entries; `apply`
is the only way the engine changes one, and it keeps the census in step (a view is counted
out before the reducer changes it and back in after). Memory is bounded: finished runs past
`[policy] keep_runs` keep only a summary (`Summaries`), summaries past `keep_summaries` more
leave memory, and `find` reads any of them back from the ledger — from the run's request on
when memory still knows it, else by a whole-ledger scan, one at a time. The census keeps
counting retired runs: its totals are of every run the daemon knows.

A finished run's view is never edited again (no entry follows its final state, and `retire`
replaces a view rather than changing it), so a snapshot may share it with a thread.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import re
from collections import OrderedDict

from daemon.errors import NotFound
from daemon.record import Body
from daemon.runs.ports import LedgerReader
from daemon.runs.replay import RedactedAfterSnapshot, apply, replay
from daemon.runs.snapshot import Snapshot
from daemon.runs.state import FINAL, Census, RunView, Summaries
from roster.models import Policy

RUN_ID = re.compile(r"r[0-9a-f]{15}")
"""What `submit` names a run: an id of another shape was never a run of this daemon."""


class RunTable:
    def __init__(self) -> None:
        self.views: dict[str, RunView] = {}
        """Runs in flight and the newest `keep_runs` finished ones, in full."""
        self.summaries = Summaries()
        """Finished runs past `keep_runs`: their summaries, up to `keep_summaries`."""
        self.census = Census()
        self._scans = asyncio.Semaphore(1)
        """Read-backs of runs memory no longer holds: whole-ledger scans, one at a time."""
        self._finished: OrderedDict[str, None] = OrderedDict()
        """Finished runs in full, oldest first (bounded by `keep_runs`)."""
        self._compacted: OrderedDict[str, None] = OrderedDict()
        """Every finished run still in memory, oldest first (`keep_runs + keep_summaries`)."""

    def get(self, run_id: str) -> RunView:
        """The run as memory holds it (a copy): in full, or its summary (see `find`)."""
        view = self.views.get(run_id)
        if view is not None:
            return view.model_copy(deep=True)
        summary = self.summaries.get(run_id)
        if summary is None:
            raise NotFound(f"no run {run_id}", details={"run": run_id})
        return summary

    def newest(self, state: str | None = None, limit: int = 50) -> list[RunView]:
        """The newest `limit` runs in memory (with this state), newest first."""
        views = self.views.values()
        full = ((v.created_at_us, v.id) for v in views if state is None or v.state == state)
        newest = heapq.nlargest(limit, itertools.chain(full, self.summaries.newest(state, limit)))
        return [self.get(run_id) for _, run_id in newest]

    async def find(self, ledger: LedgerReader, run_id: str) -> RunView:
        """The run in full: from memory, or read back from the ledger when memory holds only
        its summary (the plan, results and full texts are in the record) or nothing at all."""
        view = self.views.get(run_id)
        if view is not None and not view.summary:
            return view.model_copy(deep=True)
        held = view or self.summaries.get(run_id)
        if held is not None:  # its entries start at its request: no scan of what came before
            found = (await replay(ledger, start=held.request_seq, run=run_id)).get(run_id)
            return found or held
        if not RUN_ID.fullmatch(run_id):  # no run was ever named so: nothing to scan for
            raise NotFound(f"no run {run_id}", details={"run": run_id})
        # Not in memory: a scan of the whole ledger (in a thread). One at a time, so a client
        # asking for many unknown runs queues behind itself instead of taking every core.
        async with self._scans:
            found = (await replay(ledger, run=run_id)).get(run_id)
        if found is None:
            raise NotFound(f"no run {run_id}", details={"run": run_id})
        return found

    def apply(self, seq: int, ts: int, kind: str, run_id: str, body: Body) -> None:
        """The reducer on the live views, keeping the census in step with it. `body` is the
        model the engine witnessed: the hot path of every run entry reads it as it is."""
        before = self.views.get(run_id)
        if before is not None:
            self.census.count(before, -1)
        apply(self.views, seq, ts, kind, run_id, body)
        after = self.views.get(run_id)
        if after is not None:
            self.census.count(after)

    async def restore(
        self, ledger: LedgerReader, snapshot: Snapshot | None
    ) -> tuple[dict[str, RunView], int | None]:
        """Rebuild the views from the ledger (before anything runs) and count them: (the views
        rebuilt, the ledger size of the snapshot continued from, None for a full replay).

        With a `snapshot` (already checked against the ledger; its views are handed over) only
        the entries after it are replayed; a redaction among them replays everything instead.
        """
        views: dict[str, RunView] = {}
        if snapshot is not None:
            base = {v.id: v for v in snapshot.views}
            try:
                views = await replay(ledger, start=snapshot.size, views=base)
            except RedactedAfterSnapshot:
                snapshot = None
        if snapshot is None:
            views = await replay(ledger)
        self.views.update(views)
        self.census = Census.of(self.views.values())
        return views, None if snapshot is None else snapshot.size

    def retire(self, run_id: str, policy: Policy) -> None:
        """Bound memory: finished runs past `keep_runs` keep a summary only, and summaries past
        `keep_summaries` more leave memory (find() reads them back from the ledger)."""
        self._finished[run_id] = None
        self._compacted[run_id] = None
        while len(self._compacted) > policy.keep_runs + policy.keep_summaries:
            old, _ = self._compacted.popitem(last=False)
            self.views.pop(old, None)
            self.summaries.drop(old)
            self._finished.pop(old, None)
        while len(self._finished) > policy.keep_runs:
            old, _ = self._finished.popitem(last=False)
            view = self.views.pop(old, None)  # not edited: a snapshot may be encoding it
            if view is not None:
                self.summaries.add(view)

    def frozen(self) -> tuple[list[RunView], list[bytes]]:
        """Every full view (a finished one shared, a running one copied) and every summary's
        JSON: nothing in them changes afterwards, so they can be encoded off the loop."""
        views = [
            view if view.state in FINAL else view.model_copy(deep=True)
            for view in self.views.values()
        ]
        return views, self.summaries.encoded()
