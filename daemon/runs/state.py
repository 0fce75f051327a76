"""Run state as clients see it: RunView, TaskView, Spent, Limits, RunEvent.

These are projections of the ledger: the replay reducer (`daemon.runs.replay`) is the only
code that changes them, for live runs and for replay alike, so the two cannot drift apart.
"""

from __future__ import annotations

import heapq
from collections import Counter, OrderedDict
from collections.abc import Iterable
from typing import Any, Literal

from pydantic import BaseModel

RunState = Literal[
    "queued",
    "routing",
    "planning",
    "running",
    "synthesizing",
    "done",
    "failed",
    "cancelled",
    "interrupted",
    "budget_exhausted",
]
TaskState = Literal["pending", "running", "waiting", "done", "failed", "skipped", "cancelled"]
"""`waiting` is never in the record: the live overlay of a started task waiting for its slot
lease (`daemon.runs.waits`)."""

FINAL: frozenset[str] = frozenset({"done", "failed", "cancelled", "budget_exhausted"})
"""States a run never leaves."""
STOPPED: frozenset[str] = FINAL | {"interrupted"}
"""States in which nothing is executing (an interrupted run can be resumed)."""
TASK_ENDED: frozenset[str] = frozenset({"done", "failed", "skipped", "cancelled"})
"""Task states that count as finished in progress reports."""


class Limits(BaseModel):
    """A run's budget in ledger-safe integers; None means unlimited."""

    model_calls: int | None = None
    tokens: int | None = None
    wall_ms: int | None = None


class Spent(BaseModel):
    """What a run has used. Tokens are prompt + completion as the servers reported them."""

    model_calls: int = 0
    tokens: int = 0
    wall_ms: int = 0


class TaskView(BaseModel):
    id: str
    lane: str
    executor: str = "chat"
    needs: list[str] = []
    state: TaskState = "pending"
    attempts: int = 0
    tier: str | None = None
    member: str | None = None
    result: str | None = None
    error: str | None = None
    failures: list[str] = []
    verdict_seq: int | None = None
    steps: int = 0
    """An agent task's tool-loop steps witnessed (`agent.step`), all attempts together."""
    last_tool: str | None = None
    """The tool of its latest step (None: a malformed reply, or no step yet)."""
    started_at_us: int | None = None
    """When its first attempt started (ledger ts)."""
    ended_at_us: int | None = None
    """When its last verdict (done or failed) or skip was witnessed."""
    reused_from: str | None = None
    """The run whose done task this one took (a retried run's `task.reuse`)."""
    held: str | None = None
    """Live only: why a pending task whose needs are done has not started (a cap on tasks
    running at once; see `daemon.runs.waits`). Never in the record."""


class RunView(BaseModel):
    id: str
    state: RunState = "queued"
    request: str
    client: str | None = None
    """The named client that submitted the run (None: witnessed before clients existed)."""
    lane: str | None = None
    tasks: list[TaskView] = []
    answer: str | None = None
    spent: Spent = Spent()
    budget: Limits = Limits()
    error: str | None = None
    request_seq: int
    answer_seq: int | None = None
    created_at_us: int
    updated_at_us: int
    plan: dict[str, Any] | None = None
    """The plan as witnessed (client, coordinator or single task)."""
    plan_seq: int | None = None
    idempotency_key: str | None = None
    max_parallel: int | None = None
    barrier: bool = False
    tier: str | None = None
    """The tier the client chose for this run's tasks to start on (None: each lane's)."""
    member: str | None = None
    """The member the client chose for every task call of this run (None: the tiers')."""
    retry_of: str | None = None
    """The failed or cancelled run this one retries (`tally retry`)."""
    started_at_us: int = 0
    """When the current attempt began (request or latest resume)."""
    wall_base_ms: int = 0
    """Wall time spent by earlier attempts (before the latest resume): the wall budget carries
    it over, so a resumed run has only what is left of its wall budget."""
    workspace: str | None = None
    """The workspace the run works on (its real path), from `workspace.snapshot`."""
    workspace_content: str | None = None
    """The snapshot's content hash: a resumed run checks its new copy against it."""
    patch_seq: int | None = None
    """The `run.patch` entry with the done tasks' changes combined (`run_patch` reads it)."""
    patch_files: list[str] = []
    summary: bool = False
    """A finished run's summary kept in memory (see `compacted`): `Engine.find` reads the
    whole run back from the ledger."""

    def task(self, task_id: str) -> TaskView | None:
        return next((t for t in self.tasks if t.id == task_id), None)

    def compacted(self, chars: int = 500) -> RunView:
        """A summary: a copy without what replay can read back from the ledger on demand (the
        plan, the task results) and with every free text cut to its first `chars` (request,
        answer, errors, failures), so a summary's size is bounded whatever the run produced.
        `Engine.find` restores the whole run. Shares no mutable part with this view."""

        def cut(text: str | None) -> str | None:
            return None if text is None else text[:chars]

        tasks = [
            t.model_copy(
                update={
                    "result": None,
                    "error": cut(t.error),
                    "failures": [f[:chars] for f in t.failures[-3:]],
                }
            )
            for t in self.tasks
        ]
        return self.model_copy(
            update={
                "plan": None,
                "request": self.request[:chars],
                "answer": cut(self.answer),
                "error": cut(self.error),
                "tasks": tasks,
                "patch_files": self.patch_files[:20],
                "spent": self.spent.model_copy(),
                "budget": self.budget.model_copy(),
                "summary": True,
            }
        )


class RunEvent(BaseModel):
    """One event of a run's stream: a ledger entry (seq set) or an answer token (`delta`)."""

    seq: int | None
    kind: str
    data: dict[str, Any] | None = None


class Census:
    """Totals over every run view, kept current as views change.

    /metrics and health read these instead of walking (and copying) every run on each scrape;
    the engine subtracts a view before the reducer changes it and adds it back after.
    """

    def __init__(self) -> None:
        self.runs: Counter[str] = Counter()
        self.tasks: Counter[str] = Counter()
        self.model_calls = 0
        self.tokens = 0

    @classmethod
    def of(cls, views: Iterable[RunView]) -> Census:
        census = cls()
        for view in views:
            census.count(view)
        return census

    def count(self, view: RunView, sign: int = 1) -> None:
        self.runs[view.state] += sign
        for task in view.tasks:
            self.tasks[task.state] += sign
        self.model_calls += sign * view.spent.model_calls
        self.tokens += sign * view.spent.tokens

    def active(self) -> int:
        """Runs not in a stopped state: the ones something is executing for."""
        return sum(n for state, n in self.runs.items() if state not in STOPPED)


class Summaries:
    """Finished runs' summaries (`RunView.compacted`), oldest first, kept encoded.

    Bytes, not models: a summary costs its JSON (about a kilobyte) and nothing to the cyclic
    garbage collector, whose full passes run on the event loop and would otherwise walk a
    dozen objects per summary (tens of milliseconds at 10,000 summaries on this machine).
    Each is kept with its creation time and state, so listing decodes only what it returns.
    """

    def __init__(self) -> None:
        self._by_id: OrderedDict[str, tuple[int, str, bytes]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, run_id: object) -> bool:
        return run_id in self._by_id

    def add(self, view: RunView) -> None:
        summary = view if view.summary else view.compacted()
        self._by_id[view.id] = (view.created_at_us, view.state, summary.model_dump_json().encode())

    def get(self, run_id: str) -> RunView | None:
        held = self._by_id.get(run_id)
        return None if held is None else RunView.model_validate_json(held[2])

    def drop(self, run_id: str) -> None:
        self._by_id.pop(run_id, None)

    def newest(self, state: str | None, limit: int) -> list[tuple[int, str]]:
        """(created_at_us, run id) of the `limit` newest with this state (any: None)."""
        found = (
            (created, run_id)
            for run_id, (created, held_state, _) in self._by_id.items()
            if state is None or held_state == state
        )
        return heapq.nlargest(limit, found)

    def encoded(self) -> list[bytes]:
        """Every summary's JSON, for the snapshot (immutable: safe to join in a thread)."""
        return [held[2] for held in self._by_id.values()]
