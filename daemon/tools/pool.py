"""The daemon and its pool of model servers: health, the pool, status at a glance, stop."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import Field

from daemon import layout
from daemon.cosigning import CosignHealth
from daemon.errors import Conflict
from daemon.tls import Listener
from daemon.tools.tool import STARTED, Empty, Tool, ToolContext, _Out
from daemon.version import package_version

if TYPE_CHECKING:
    from daemon.service import Daemon
    from daemon.slots import PoolStatus

# ---------------------------------------------------------------- health


CommandSandbox = Annotated[
    Literal["bwrap", "none", "off"],
    Field(
        description="How command tasks run: in bubblewrap, unsandboxed (an explicit roster "
        "opt-in), or not at all."
    ),
]


class HealthOut(_Out):
    status: Literal["ok", "degraded"] = "ok"
    reason: str | None = Field(
        default=None, description="Why `degraded`, e.g. the ledger cannot write (disk full)."
    )
    ledger_writable: bool = Field(
        default=True, description="False while writes fail; appends get 503 until it recovers."
    )
    version: str
    uptime_s: float
    ledger_size: int
    runs_active: int
    runs_queued: int = Field(description="Runs waiting for a run slot (bounded by policy).")
    lanes: int
    members: int
    command_sandbox: CommandSandbox
    loop_lag_worst_s: float = Field(
        default=0.0,
        description="The longest the event loop was late in the last minute (all requests "
        "wait that long).",
    )
    listener: Listener | None = Field(
        default=None,
        description="The TCP listener: its URL, whether it is TLS (and the certificate's "
        "fingerprint clients pin), and whether plain HTTP beyond loopback was asked for "
        "(`--insecure-http`). Null: unix socket only.",
    )
    cosigning: CosignHealth | None = Field(
        default=None,
        description="Cosigned checkpoints: per cosigner (a `cosign` member, or a daemon "
        "sharing the record) the last checkpoint of ours it cosigned, how long ago, the failed "
        "asks since; whether the latest checkpoint has them all. Null: no cosigners.",
    )


def command_sandbox(daemon: Daemon) -> Literal["bwrap", "none", "off"]:
    policy = daemon.roster.policy.command
    return policy.sandbox if policy.enabled else "off"


async def health(daemon: Daemon, _: Empty, ctx: ToolContext) -> HealthOut:
    ledger = daemon.ledger.health
    return HealthOut(
        status="ok" if ledger.writable else "degraded",
        reason=None if ledger.writable else f"the ledger cannot write: {ledger.detail}",
        ledger_writable=ledger.writable,
        version=package_version(),
        uptime_s=round(time.monotonic() - STARTED, 3),
        ledger_size=daemon.ledger.size,
        runs_active=daemon.engine.census.active(),
        runs_queued=daemon.engine.queued(),
        lanes=len(daemon.roster.lanes),
        members=len(daemon.roster.models),
        command_sandbox=command_sandbox(daemon),
        loop_lag_worst_s=round(daemon.lag.worst(), 6),
        listener=_listener_for(daemon, ctx),
        cosigning=await daemon.collector.health(daemon.ledger, daemon.roster),
    )


HEALTH = Tool(
    "health",
    "Check that the tally daemon is up: version, uptime, ledger size, active runs, "
    "lanes and pool members. Cheap; use it first when unsure tally is running.",
    Empty,
    HealthOut,
    health,
    errors=(),
)


def _listener_for(daemon: Daemon, ctx: ToolContext) -> Listener | None:
    """The listener as the caller may see it: where the state dir is is the admin's business."""
    listener = daemon.listener
    if listener is None or ctx.client.allows("admin"):
        return listener
    return listener.model_copy(update={"cert_path": None})


class SlotInstanceOut(_Out):
    index: int
    state: str = Field(
        description="stopped, starting, ready, backoff, stopping, cooldown, unhealthy (an "
        "external server that does not answer: probed, never restarted)"
    )
    port: int | None = None
    pid: int | None = None
    url: str | None = None
    slots_total: int = 0
    slots_busy: int = 0
    slots_idle: int = 0
    n_ctx: int | None = None
    restarts: int = 0
    last_error: str | None = None


class SlotMemberOut(_Out):
    name: str
    external: bool = Field(description="True for a `url` member tally does not spawn.")
    state: str
    queue: int = Field(description="Callers waiting for a slot of this member.")
    max_queue: int
    leases: int = Field(description="Slots leased right now.")
    restarts: int = 0
    failures: int = 0
    cooldown_remaining_ms: int = 0
    last_error: str | None = None
    instances: list[SlotInstanceOut] = Field(default=[])
    healthy: bool = Field(
        default=True, description="False while it takes no lease (cooling down, unreachable)."
    )
    unhealthy_ms: int = Field(default=0, description="How long it has been unreachable.")
    next_probe_ms: int | None = Field(default=None, description="When it is probed next.")
    downs: int = Field(default=0, description="Times it became unreachable.")
    recoveries: int = Field(default=0, description="Times it answered again after that.")


class SlotTierOut(_Out):
    name: str
    members: list[str]
    queue: int = Field(
        description="Callers waiting for any member of this tier (runs lease by tier)."
    )
    max_queue: int
    healthy: list[str] = Field(default=[], description="Members that can take a lease now.")
    failovers: int = Field(
        default=0, description="Leases a higher tier served because none here could."
    )
    in_flight_failovers: int = Field(
        default=0,
        description="Calls moved to another member of this tier after theirs failed mid-call.",
    )


class SlotsOut(_Out):
    members: list[SlotMemberOut]
    tiers: list[SlotTierOut] = Field(default=[])
    busy: int = Field(description="Busy slots across all members.")
    idle: int = Field(description="Idle slots of running instances.")
    queue: int = Field(description="Callers waiting for a slot, tier and member queues together.")
    command_sandbox: CommandSandbox = "bwrap"


def slots_out(status: PoolStatus) -> SlotsOut:
    members = [SlotMemberOut.model_validate(m.model_dump(mode="json")) for m in status.members]
    instances = [i for m in members for i in m.instances]
    return SlotsOut(
        members=members,
        tiers=[SlotTierOut.model_validate(t.model_dump(mode="json")) for t in status.tiers],
        busy=sum(i.slots_busy for i in instances),
        idle=sum(i.slots_idle for i in instances if i.state == "ready"),
        queue=status.queued,
    )


async def slots_status(daemon: Daemon, _: Empty, ctx: ToolContext) -> SlotsOut:
    return slots_out(daemon.pool.status()).model_copy(
        update={"command_sandbox": command_sandbox(daemon)}
    )


SLOTS_STATUS = Tool(
    "slots_status",
    "Show the local model server pool: members, instances, state, port, busy and idle "
    "slots, queue depth, restarts and last error. Use it when runs are slow or failing.",
    Empty,
    SlotsOut,
    slots_status,
    errors=(),
)


# ---------------------------------------------------------------- status and stop (daily use)


class StatusDaemonOut(_Out):
    pid: int
    version: str
    started_at_us: int = Field(description="When the daemon started (wall clock, µs).")
    uptime_s: float
    listeners: list[str] = Field(description="Where it listens: unix:PATH, http://HOST:PORT.")
    state_dir: str


class StatusRunsOut(_Out):
    by_state: dict[str, int] = Field(
        description="Runs in memory by state as shown: a run whose work waits for a slot "
        "counts as `queued`, not `running`."
    )
    tasks_by_state: dict[str, int] = Field(
        description="Tasks of runs in memory by state as shown (`waiting`: for a slot)."
    )
    in_flight: int = Field(description="Runs being driven now (what a stop drains).")


class StatusLedgerOut(_Out):
    size: int = Field(description="Entries in the ledger.")
    bytes: int | None = Field(default=None, description="The entries file's size on disk.")
    writable: bool
    reason: str | None = Field(default=None, description="Why it cannot write (degraded).")
    checkpoint_size: int | None = Field(default=None, description="The last signed tree size.")
    checkpoint_time_us: int | None = Field(default=None, description="When it was signed.")


class StatusRoutingOut(_Out):
    embeddings: str | None = Field(
        description="The embedding member (`[policy] embeddings`); null: keyword routing only."
    )
    state: Literal["off", "not built", "building", "ready", "down"] = Field(
        description="Its example vectors: ready (routes use them); building, not built or "
        "down (routes fall back to the keyword scores, `why`)."
    )
    why: str | None = None
    examples: int = 0
    reused: int = Field(default=0, description="Example vectors taken from the cache.")
    computed: int = Field(default=0, description="Example vectors the member computed.")
    build_ms: int = 0
    cache_problem: str | None = Field(
        default=None, description="Why the cache file was not used at the last build."
    )


class StatusOut(_Out):
    status: Literal["ok", "degraded"]
    daemon: StatusDaemonOut
    pool: SlotsOut
    runs: StatusRunsOut
    ledger: StatusLedgerOut
    routing: StatusRoutingOut | None = None


def _entries_bytes(daemon: Daemon) -> int | None:
    try:
        return (layout.ledger_dir(Path(daemon.settings.state_dir)) / layout.ENTRIES).stat().st_size
    except OSError:
        return None


async def status(daemon: Daemon, _: Empty, ctx: ToolContext) -> StatusOut:
    import os

    engine = daemon.engine
    runs, tasks = engine.shown_census()
    health = daemon.ledger.health
    cp = daemon.ledger.latest_checkpoint()
    return StatusOut(
        status="ok" if health.writable else "degraded",
        daemon=StatusDaemonOut(
            pid=os.getpid(),
            version=package_version(),
            started_at_us=daemon.started_at_us,
            uptime_s=round(time.monotonic() - STARTED, 3),
            listeners=list(daemon.listeners),
            state_dir=str(daemon.settings.state_dir),
        ),
        pool=await slots_status(daemon, Empty(), ctx),
        runs=StatusRunsOut(by_state=runs, tasks_by_state=tasks, in_flight=engine.in_flight()),
        ledger=StatusLedgerOut(
            size=daemon.ledger.size,
            bytes=await asyncio.to_thread(_entries_bytes, daemon),
            writable=health.writable,
            reason=None if health.writable else health.detail,
            checkpoint_size=None if cp is None else cp.size,
            checkpoint_time_us=None if cp is None else cp.time_us,
        ),
        routing=_routing_status(daemon),
    )


STATUS = Tool(
    "status",
    "The daemon at a glance: pid, uptime, version and listeners; the pool (members, "
    "loaded instances, busy slots, queues); runs and tasks by state (`queued`/`waiting` "
    "for a slot); the ledger (size, last checkpoint, writable or degraded).",
    Empty,
    StatusOut,
    status,
    errors=(),
)


def _routing_status(daemon: Daemon) -> StatusRoutingOut:
    embeddings = daemon.router.embeddings
    if embeddings is None:
        return StatusRoutingOut(embeddings=None, state="off")
    shown = embeddings.status()
    return StatusRoutingOut(
        embeddings=shown["member"],
        state=shown["state"],
        why=shown["why"],
        examples=shown["examples"],
        reused=shown["reused"],
        computed=shown["computed"],
        build_ms=shown["build_ms"],
        cache_problem=shown["cache_problem"],
    )


class StopOut(_Out):
    stopping: bool = Field(description="True: the daemon is stopping now.")
    draining: int = Field(description="Runs in flight it lets finish first.")
    drain_s: float = Field(description="How long it lets them run before it interrupts them.")


async def daemon_stop(daemon: Daemon, _: Empty, ctx: ToolContext) -> StopOut:
    stop = daemon.stop_requested
    if stop is None:  # an embedded daemon (tests, a library user): its owner stops it
        raise Conflict("this daemon is not run by `tally serve`: stop it where it runs")
    # After this answer is on its way: the server stops as on SIGTERM (drain, interrupt the
    # rest, checkpoint, release the ledger).
    asyncio.get_running_loop().call_soon(stop.set)
    return StopOut(
        stopping=True, draining=daemon.engine.in_flight(), drain_s=daemon.settings.drain_s
    )


DAEMON_STOP = Tool(
    "daemon_stop",
    "Stop the daemon cleanly: runs in flight drain for the configured time, the rest are "
    "interrupted (resumable), then it checkpoints and exits.",
    Empty,
    StopOut,
    daemon_stop,
    scope="admin",
    errors=(Conflict,),
)
