"""Runs read from the record with the daemon down: `tally runs` and `tally run ID` offline.

The ledger is opened read-only (no lock, no write: a read-only command never changes the
record) and the replay reducer rebuilds the run views from it without any model call, as
`run_replay` does. The run-state snapshot, when it still matches the ledger's prefix, saves
replaying what it covers. A run that was in flight when the daemon stopped shows the state
the record last witnessed: the next start marks it `interrupted`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from daemon import layout

OFFLINE_NOTE = (
    "tally: the daemon is not running ({where}); read {what} from the record in {state} "
    "(read-only, no model call)"
)


class NoRecord(Exception):
    """No ledger in the state dir."""


async def _views(state: Path, run_id: str | None) -> dict[str, Any]:
    from daemon.ledger import Ledger
    from daemon.runs import snapshot as snapshots
    from daemon.runs.replay import RedactedAfterSnapshot, replay

    if not (state / layout.LEDGER).is_dir():
        raise NoRecord(f"no ledger in {state}")
    ledger = await Ledger.open(state, readonly=True)
    try:
        if run_id is not None:  # one run, in full (its plan and outputs, not a summary)
            return await replay(ledger, run=run_id)
        snap = snapshots.load(state, ledger)
        if snap is not None:
            try:
                views = {v.id: v for v in snap.views}
                return await replay(ledger, start=snap.size, views=views)
            except RedactedAfterSnapshot:
                pass
        return await replay(ledger)
    finally:
        await ledger.close()


async def runs(state: Path, only: str | None, limit: int) -> list[dict[str, Any]]:
    """The newest `limit` runs (in state `only`), newest first, as `runs_list` gives them."""
    from daemon.tools import run_out

    views = (await _views(state, None)).values()
    chosen = [v for v in views if only is None or v.state == only]
    chosen.sort(key=lambda v: (v.created_at_us, v.id), reverse=True)
    return [run_out(v).model_dump(mode="json") for v in chosen[:limit]]


async def run(state: Path, run_id: str) -> dict[str, Any] | None:
    """One run in full as `run_get` gives it, or None if the record has no such run."""
    from daemon.tools import run_out

    view = (await _views(state, run_id)).get(run_id)
    return None if view is None else run_out(view).model_dump(mode="json")
