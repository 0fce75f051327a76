"""The run feed: the runs that changed since a cursor, as the console's runs page lists them.

A poll, answered at once: the console's `GET /v1/events` stream pushes the same answers (it
waits for `changed`, then asks this tool), and any other client polls it with the cursor of its
last answer. A first call (no cursor), or a cursor this daemon cannot answer from (another
daemon's, one from before a restart, one older than what it keeps), answers `reset`: list the
runs afresh (runs_list), then poll from the cursor given.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Annotated

from pydantic import Field

from daemon.errors import NotFound
from daemon.runs.changes import CURSOR
from daemon.runs.state import TASK_ENDED, RunState
from daemon.tools.tool import SpentOut, Tool, ToolContext, _In, _Out
from roster.models import Whole

if TYPE_CHECKING:
    from daemon.runs.state import RunView
    from daemon.service import Daemon


class RunFeedIn(_In):
    after: str | None = Field(
        default=None,
        pattern=f"^{CURSOR}$",
        description="The `cursor` of your last answer; none: start (answers `reset` and the "
        "cursor to poll from).",
    )
    limit: Annotated[int, Field(ge=1, le=1000), Whole] = Field(
        default=200, description="At most this many runs (`more`: ask again for the rest)."
    )


class RunSummaryOut(_Out):
    """A run as the runs page lists it (every field is also in run_get's answer)."""

    id: str
    state: RunState
    lane: str | None = None
    lanes: list[str] = Field(description="Its tasks' lanes, each once, in plan order.")
    client: str | None = None
    request: str = Field(description="The request's first 200 characters.")
    tasks_total: int
    tasks_done: int
    created_at_us: int | None = None
    updated_at_us: int | None = None
    spent: SpentOut


class RunFeedOut(_Out):
    runs: list[RunSummaryOut] = Field(
        description="The runs changed since `after`, each once as it stands now, in the order "
        "of their latest change."
    )
    cursor: str = Field(description="Pass it as `after` next time.")
    reset: bool = Field(
        description="True: `after` could not be answered from (none, another daemon's, or too "
        "old); `runs` is empty: list the runs afresh (runs_list), then poll from `cursor`."
    )
    more: bool = Field(description="True: more runs changed than `limit`; ask again now.")


def run_summary(view: RunView) -> RunSummaryOut:
    return RunSummaryOut(
        id=view.id,
        state=view.state,
        lane=view.lane,
        lanes=list(dict.fromkeys(t.lane for t in view.tasks if t.lane is not None)),
        client=view.client,
        request=view.request[:200],
        tasks_total=len(view.tasks),
        tasks_done=sum(t.state in TASK_ENDED for t in view.tasks),
        created_at_us=view.created_at_us,
        updated_at_us=view.updated_at_us,
        spent=SpentOut.model_validate(view.spent.model_dump()),
    )


async def run_feed(daemon: Daemon, data: RunFeedIn, ctx: ToolContext) -> RunFeedOut:
    changes = daemon.engine.changes
    after = changes.tick_of(data.after)
    if after is None:
        return RunFeedOut(runs=[], cursor=changes.cursor(), reset=True, more=False)
    found = changes.since(after)
    taken = found[: data.limit]
    runs = []
    for run_id, _ in taken:
        with contextlib.suppress(NotFound):  # a run the table no longer holds: nothing to show
            runs.append(run_summary(daemon.engine.shown(daemon.engine.get(run_id))))
    more = len(found) > len(taken)
    cursor = changes.cursor(taken[-1][1] if more else None)
    return RunFeedOut(runs=runs, cursor=cursor, reset=False, more=more)


RUN_FEED = Tool(
    "run_feed",
    "The runs that changed since your last call, each once as it stands now (state, lanes, "
    "tasks done, spending), with a cursor to pass next time. Start without one: the answer "
    "says `reset` (list the runs with runs_list) and gives the cursor to poll from. Use it to "
    "follow what tally is doing without re-reading every run.",
    RunFeedIn,
    RunFeedOut,
    run_feed,
    errors=(),
)


async def changed(daemon: Daemon, cursor: str, timeout: float) -> bool:
    """Wait up to `timeout` s for runs to change after `cursor` (False: none did), for the
    surfaces that push the feed; a cursor the feed cannot answer from is answered at once."""
    changes = daemon.engine.changes
    after = changes.tick_of(cursor)
    if after is None:
        return True
    return await changes.changed(after, timeout)
