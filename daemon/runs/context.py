"""What a run's steps are given: the engine's setting, shared by every run, and one run's own state.

The steps (`routing`, `planning`, `calls`, `attempts`, `tasks`, `synthesis`, `lifecycle`) are
functions of a `Setting` and a `Run`; none of them imports the engine. The engine builds one
`Setting` and hands it every step, and one `Run` per run it drives.

`Setting` holds the parts below the engine (ledger reads, pool, router), its options, the
roster in force and the engine's own `witness` and `delta`. A roster change (`use`) replaces
the roster, lanes, task capacity and run gate in place: a step reads them when it needs them,
so a step that begins after the change sees the new roster, one already going keeps what it
read. `witness` is the only way a step writes: it appends the entry, applies it to the live
view (`views`) before returning its seq, and tells watchers and listeners.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from daemon import record as rec
from daemon.plans import Plan
from daemon.router import classifier_of
from daemon.runs.budget import Meter
from daemon.runs.dispatch import Capacity
from daemon.runs.executors import Stub
from daemon.runs.ports import LedgerReader, PoolPort, RouterPort
from daemon.runs.sandbox import Confinement
from daemon.runs.state import RunView
from daemon.runs.waits import Waits
from daemon.workspace.view import RunDirs
from roster.models import Lane, Roster

Witness = Callable[[str, rec.Body, int | None], Awaitable[int]]
"""(run id, kind, body, parent) -> the entry's seq, once it is durable and applied."""
Delta = Callable[[str, str, str | None], None]
"""(run id, streamed text, task id or None for the synthesis) -> None: to live listeners only."""


@dataclass(frozen=True)
class EngineOptions:
    max_tasks: int = 256
    """Tasks in flight across every run (the daemon-wide cap)."""
    coordinator: str | None = None
    """Tier or member asked to plan when the client gives no plan; None = the roster's policy."""
    judge: str | None = None
    """Tier or member asked to judge a task's output; None = the roster's policy."""
    command_timeout_s: float = 60.0
    confinement: Confinement = field(default_factory=Confinement)
    """Paths no command task may see and where task dirs go (the daemon's own dirs)."""
    max_tokens: int = 512
    guard_attempts: int = 3
    key_ttl_s: float = 86_400.0
    """How long an Idempotency-Key keeps returning its run; after that it starts a new one."""
    max_keys: int = 100_000
    """Idempotency keys remembered at once; past this the oldest are forgotten first."""
    lost_call_retries: int = 3
    """How many times a model call lost to its server is sent again (see `calls`)."""
    lost_call_wait_s: float = 60.0
    """How long each resend may wait for a slot (a restarting server, a member coming back)."""
    workspace_roots: tuple[Path, ...] = ()
    """Where a run's workspace may be, besides the roster's `[policy.workspace] roots`."""


class TaskFailed(Exception):
    pass


class Setting:
    """The engine as its steps see it (see the module docstring)."""

    def __init__(
        self,
        *,
        ledger: LedgerReader,
        pool: PoolPort,
        router: RouterPort,
        options: EngineOptions,
        stub: Stub | None,
        roster: Roster,
        views: Mapping[str, RunView],
        witness: Witness,
        delta: Delta,
        waits: Waits | None = None,
    ) -> None:
        self.ledger = ledger
        self.pool = pool
        self.router = router
        self.options = options
        self.stub = stub
        self.views = views
        self.witness = witness
        self.delta = delta
        self.waits = waits or Waits()
        """Who waits for a slot now (live only, never witnessed): see `daemon.runs.waits`."""
        self.use(roster)

    def use(self, roster: Roster) -> None:
        """The roster for steps that begin from now on, its lanes, task caps and run gate."""
        self.roster = roster
        self.lanes: dict[str, Lane] = {lane.name: lane for lane in roster.lanes}
        self.gate = asyncio.Semaphore(roster.policy.max_runs)
        self.capacity = Capacity(
            self.options.max_tasks,
            {lane.name: lane.max_concurrency for lane in roster.lanes if lane.max_concurrency},
        )

    @property
    def coordinator(self) -> str | None:
        return self.options.coordinator or self.roster.policy.coordinator

    @property
    def classifier(self) -> str | None:
        """The roster's classifier, if it is stronger than the lanes' first rung: a tier whose
        members all serve the first rung too would add a model call and no judgment."""
        return classifier_of(self.roster)

    @property
    def judge(self) -> str | None:
        return self.options.judge or self.roster.policy.judge


@dataclass
class Run:
    """What only a running run needs (its view lives in the engine's run table)."""

    id: str
    meter: Meter
    task: asyncio.Task[None] | None = None
    started: asyncio.Event = field(default_factory=asyncio.Event)
    cancelling: bool = False
    interrupting: bool = False
    finished: asyncio.Event = field(default_factory=asyncio.Event)
    outputs: dict[str, str] = field(default_factory=dict)
    client_plan: Plan | None = None
    fresh: bool = True
    space: RunDirs | None = None
    """The run's workspace dirs on disk (snapshot, views), if it has a workspace."""
    diffs: dict[str, str] = field(default_factory=dict)
    """Each done task's changes to its view (a unified diff), for the tasks that need it."""


def describe(exc: BaseException) -> str:
    """An error as a witnessed body states it: its type and message, at most 500 characters."""
    message = getattr(exc, "message", None) or str(exc) or type(exc).__name__
    text = f"{type(exc).__name__}: {message}"
    return text if len(text) <= 500 else text[:499] + "…"
