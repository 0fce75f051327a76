"""The Daemon: owns the ledger, the roster, the slot pool, the router and the runs engine.

`start()` opens the ledger (which recovers a torn tail), loads the roster, creates the pool
(lazy: no model server starts before the first lease), and reconciles — every run the ledger
shows in flight becomes `interrupted`, witnessed, so nothing is left "running" that is not.
`stop()` lets runs drain for `settings.drain_s`, interrupts the rest (resumable), stops the
pool and writes a checkpoint.

In the background after start, the pool's members are checked as `tally doctor --no-spawn`
does, but without the one-token completion (a model call the ledger would not witness):
external servers are asked whether they answer, list the model, and their context and slots;
spawned ones have their command and model file checked. Each problem is logged as a warning
with its fix; readiness never waits for it.

Start-up is bounded by the run-state snapshot (`daemon.runs.snapshot`): written after start
(at the warm-up, once the key that seals it loads), every `snapshot_interval_s` and on stop, it
lets `start()` replay only the entries after it; without a valid one (its seal the ledger
owner's, its stamp the ledger's), start-up replays the whole ledger (the result is the same).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from pathlib import Path
from typing import Any

from daemon import record as rec
from daemon.clients import ClientStore
from daemon.config import Settings
from daemon.cosigning import Collector, Cosigner, collect_loop
from daemon.errors import InvalidRoster, TallyError
from daemon.gateway import REPLY as GATEWAY_REPLY
from daemon.gateway import Gateway
from daemon.lag import LoopLag
from daemon.latencies import RunTimings
from daemon.ledger import Ledger
from daemon.quotas import DAY_S, Quotas
from daemon.router import Router
from daemon.runs import entries as k
from daemon.runs import snapshot as snapshots
from daemon.runs.engine import Engine, EngineOptions
from daemon.runs.executors import watch_children_with_pidfd
from daemon.runs.limits import MemoryCgroup, detect_memory_cgroup
from daemon.runs.sandbox import Confinement, clear_task_dirs, tasks_root
from daemon.slots import Pool, PoolOptions, SlotEvent
from daemon.tls import Listener
from roster.loading import RosterError, default_roster_path, load_roster
from roster.models import Roster

log = logging.getLogger(__name__)


class Daemon:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._ledger: Ledger | None = None
        self._pool: Pool | None = None
        self._engine: Engine | None = None
        self._roster: Roster | None = None
        self._router: Router | None = None
        self._gateway: Gateway | None = None
        self._snapshots: asyncio.Task[None] | None = None
        self._checkup: asyncio.Task[None] | None = None
        self._warming: asyncio.Task[None] | None = None
        self._snapshot_size = -1
        self.interrupted_on_start: list[str] = []
        self.restored_from: int | None = None
        """The ledger size the start-up snapshot covered (None: the whole ledger was replayed)."""
        self.start_seconds = 0.0
        self.listener: Listener | None = None
        """The TCP listener, once it listens (`health` shows it; None = unix socket only)."""
        self.clients = ClientStore(settings.state_dir)
        self.quotas = Quotas()
        """Named clients' rate limits and token budgets, enforced on the gateway and on runs."""
        self.lag = LoopLag()
        self.timings = RunTimings()
        """Latency histograms (/metrics), fed by the engine as it witnesses run entries."""
        self._tracer: Any = None
        self._memory_cgroup: MemoryCgroup | None = None
        self.listeners: list[str] = []
        """Where the surfaces listen (`unix:PATH`, `http://HOST:PORT`), set by the server."""
        self.stop_requested: asyncio.Event | None = None
        """Set by `daemon_stop` (a client's clean stop): the server then stops as on SIGTERM."""
        self.started_at_us = time.time_ns() // 1000
        self.cosigner: Cosigner | None = None
        """This daemon as the cosigner of other daemons' checkpoints (`ledger_cosign`)."""
        self.collector = Collector()
        """This daemon asking its `cosign = true` members to cosign its checkpoints."""
        self._cosigning: asyncio.Task[None] | None = None

    # The parts exist only between start() and stop(); asking earlier is a programming error.
    @property
    def ledger(self) -> Ledger:
        assert self._ledger is not None, "Daemon.start() first"
        return self._ledger

    @property
    def pool(self) -> Pool:
        assert self._pool is not None, "Daemon.start() first"
        return self._pool

    @property
    def engine(self) -> Engine:
        assert self._engine is not None, "Daemon.start() first"
        return self._engine

    @property
    def gateway(self) -> Gateway:
        assert self._gateway is not None, "Daemon.start() first"
        return self._gateway

    @property
    def roster(self) -> Roster:
        assert self._roster is not None, "Daemon.start() first"
        return self._roster

    @property
    def router(self) -> Router:
        assert self._router is not None, "Daemon.start() first"
        return self._router

    @property
    def roster_path(self) -> Path:
        return self.settings.roster_path or default_roster_path()

    async def start(self) -> None:
        settings = self.settings
        started = time.perf_counter()
        settings.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        watch_children_with_pidfd()  # no thread started per command task or model server
        roster = _loaded(self.roster_path)  # a bad roster at start is fatal: nothing to keep
        # The ledger's own timer is the one checkpoint timer: it signs every interval, and
        # only when the tree grew since the last checkpoint.
        if settings.ledger_url:  # the shared record (daemon.ledger.shared)
            from daemon.ledger.shared import SharedLedger

            self._ledger = await SharedLedger.open_shared(
                settings.ledger_url,
                settings.state_dir,
                checkpoint_interval=settings.checkpoint_interval_s,
            )
        else:
            self._ledger = await Ledger.open(
                settings.state_dir, checkpoint_interval=settings.checkpoint_interval_s
            )
        try:
            self._roster = roster
            # relative model paths resolve against the roster's directory, as in `tally doctor`
            options = PoolOptions(roster_dir=self.roster_path.parent)
            self._pool = Pool(
                roster, settings.state_dir, on_event=self._on_slot_event, options=options
            )
            self._router = self._router_of(roster)
            await self._pool.start()
            self._memory_cgroup = await self._detect_memory_cgroup(roster)
            self._gateway = Gateway(self._pool, self._ledger, roster, self.quotas)
            self._engine = Engine(
                self._ledger,
                self._pool,
                roster,
                self._router,
                options=EngineOptions(
                    confinement=self.confinement(),
                    max_tasks=settings.max_tasks,
                    coordinator=settings.coordinator,
                    judge=settings.judge,
                    workspace_roots=settings.workspace_roots,
                ),
            )
            self._engine.watch(self.timings)
            self._engine.watch(self._count_run_tokens)
            self._tracer = self._start_tracing()
            await asyncio.to_thread(clear_task_dirs, self.confinement().tasks_root)
            await self._witness_command_policy(roster)
            base = snapshots.load(settings.state_dir, self._ledger)
            self.interrupted_on_start = await self._engine.restore(base)
            self.restored_from = self._engine.restored_from
            if self.restored_from is not None:
                self._snapshot_size = self.restored_from
            # The start's snapshot is written by the warm-up (`warm`): it is signed, and the
            # signature library loads after the first answer, not before.
            await self._rebuild_quotas()
        except BaseException:
            await self._ledger.close()
            raise
        self._snapshots = asyncio.create_task(self._snapshot_loop(), name="run snapshots")
        self.lag.start()
        self._checkup = asyncio.create_task(self._check_members(roster), name="member checkup")
        # A shared record: the other daemons writing it are cosigned (`cosign_shared`).
        self.cosigner = Cosigner(self._ledger, same_record=getattr(self._ledger, "shared", False))
        self._cosigning = asyncio.create_task(
            collect_loop(
                self.collector,
                self._ledger,
                lambda: self.roster,
                settings.checkpoint_interval_s,
                self.cosigner,
            ),
            name="cosignatures",
        )
        self.start_seconds = time.perf_counter() - started

    def _count_run_tokens(self, entry: Any, body: rec.Body) -> None:
        """A run's model reply counts its tokens against the client that submitted the run."""
        if not isinstance(body, rec.ModelReply) or entry.run is None:
            return
        view = self.engine.table.views.get(entry.run)
        if view is not None and view.client is not None:
            self.quotas.spend(view.client, _tokens(body))

    async def _rebuild_quotas(self) -> None:
        """The last 24 hours of replies, counted against their clients (`daemon.quotas`), so a
        restart does not reset a day's budget. Only when some client has a limit: a daemon
        without limits reads nothing here."""
        if not any(r.limits is not None for r in self.clients.known()):
            return
        ledger = self.ledger
        end = ledger.size
        start = await _first_since(ledger, int((self.quotas.clock() - DAY_S) * 1e6), end)
        runs: dict[str, str | None] = {}
        seq = start
        while seq < end:
            batch = [e for e in await ledger.entries(start=seq, limit=1000) if e.seq < end]
            if not batch:
                break
            wanted = [e.body if e.kind in _USAGE_KINDS else None for e in batch]
            for entry, found in zip(batch, await ledger.read_bodies(wanted), strict=True):
                # A body redacted, missing or not of its kind's shape spends nothing: a quota
                # is rebuilt from what the record says for certain, never from a guess.
                model = rec.model_for(entry.kind)
                body = None if model is None else model.parsed(found.value)
                if isinstance(body, rec.RunRequest) and entry.run is not None:
                    runs[entry.run] = body.client
                    continue
                if isinstance(body, rec.GatewayReply):
                    who: str | None = body.client
                elif isinstance(body, rec.ModelReply):
                    who = self._client_of(entry.run, runs)
                else:
                    continue
                if who is not None:
                    self.quotas.spend(who, _tokens(body), at=entry.ts / 1e6)
            seq = batch[-1].seq + 1

    def _client_of(self, run: str | None, runs: dict[str, str | None]) -> str | None:
        if run is None:
            return None
        if run not in runs:
            view = self.engine.table.views.get(run)
            runs[run] = view.client if view is not None else None
        return runs[run]

    def _router_of(self, roster: Roster) -> Router:
        """A router for `roster`, with its embedding member when it names one (the example
        vectors are built in the background, from the cache in `<state>/embeddings/`)."""
        from daemon import embeddings

        found = embeddings.of(roster, self.pool, self.settings.state_dir)
        return Router(roster, embeddings=found)

    def warm(self) -> None:
        """Load what a start leaves for later (`surfaces.http.warm` calls this once listening):
        the router's index here on the loop, the ledger's signing key on a worker thread, and
        the embedding member's example vectors in the background."""
        self.router.prepare()
        if self.router.embeddings is not None:
            self.router.embeddings.start()
        self._warming = asyncio.create_task(self._warm_up())
        self._warming.add_done_callback(_said_if_failed)

    async def _warm_up(self) -> None:
        """The signing key, then the start's run snapshot (sealed with it)."""
        await asyncio.to_thread(self.ledger.load_signer)
        try:
            await self.write_snapshot()
        except Exception:  # derived data: the next period retries
            log.exception("run snapshot failed")

    def _start_tracing(self) -> Any:
        """The OTLP exporter, if configured (the SDK is imported only then)."""
        settings = self.settings
        if not settings.otlp_endpoint:
            return None
        try:
            from daemon.tracing import OtlpOptions, RunTracer
        except ImportError as exc:
            log.warning("OTLP traces asked for, but %s: pip install 'tallyd[otel]'", exc)
            return None
        tracer = RunTracer(
            OtlpOptions(
                settings.otlp_endpoint, settings.otlp_headers, settings.otel_capture_content
            )
        )
        self.engine.watch(tracer)
        log.info("exporting run traces to %s", settings.otlp_endpoint)
        return tracer

    def confinement(self) -> Confinement:
        """What command tasks must never see: the daemon's state, socket, key and home dirs."""
        hidden = [self.settings.state_dir, self.settings.runtime_dir, Path.home()]
        credentials = os.environ.get("CREDENTIALS_DIRECTORY")
        if credentials:
            hidden.append(Path(credentials))
        return Confinement(
            hidden=tuple(hidden),
            tasks_root=tasks_root(self.settings.state_dir),
            memory_cgroup=self._memory_cgroup,
        )

    @staticmethod
    async def _detect_memory_cgroup(roster: Roster) -> MemoryCgroup | None:
        """The cgroup memory limit command tasks run under, if the machine offers one (a
        roster that runs no sandboxed commands at start does not look)."""
        policy = roster.policy.command
        if not policy.enabled or policy.sandbox != "bwrap":
            return None
        cgroup, said = await asyncio.to_thread(detect_memory_cgroup)
        log.info("command tasks: %s", said)
        return cgroup

    async def _witness_command_policy(self, roster: Roster) -> None:
        """An unsandboxed command executor is an explicit choice: put it on the record."""
        policy = roster.policy.command
        if policy.enabled and policy.sandbox == "none":
            log.warning("command tasks run WITHOUT a sandbox ([policy.command] sandbox = none)")
            body = rec.PolicyUnsandboxed(roster=str(self.roster_path), command=policy.model_dump())
            await self.ledger.append(actor="daemon", kind=body.KIND, body=body.written())

    async def witness_listener(self, listener: Listener) -> None:
        """The TCP listener listens; plain HTTP beyond loopback is an explicit choice
        (`--insecure-http`): put it on the record."""
        if listener.insecure_http:
            log.warning("serving plain HTTP on %s (--insecure-http)", listener.url)
            said = rec.ServeInsecureHttp(url=listener.url, host_names=list(listener.host_names))
            await self.ledger.append(actor="daemon", kind=said.KIND, body=said.written())
        self.listener = listener

    async def write_snapshot(self) -> None:
        """Write the run-state snapshot if the ledger grew since the last one (the views match
        the ledger's size at every step: see Engine.snapshot)."""
        size, views, summaries = self.engine.snapshot()
        if size == self._snapshot_size:
            return  # nothing changed since the last one
        stamped = snapshots.stamp(self.ledger, size, views)  # the ledger is read on the loop
        # The views are copies and the summaries bytes (see Engine.snapshot): encode and write
        # them off the loop.
        await asyncio.to_thread(
            snapshots.write, self.settings.state_dir, stamped, summaries, self.ledger.seal
        )
        self._snapshot_size = size

    def roster_allowed(self, path: Path) -> bool:
        """A client may load only the configured roster or a file in a roster directory (the
        configured roster's own, and `settings.roster_dirs`), symlinks resolved."""
        real = Path(os.path.realpath(path))
        if real == Path(os.path.realpath(self.roster_path)):
            return True
        dirs = (self.roster_path.parent, *self.settings.roster_dirs)
        return any(real.parent == Path(os.path.realpath(d)) for d in dirs)

    async def reload_roster(self, path: Path | None = None, client: str = "owner") -> Roster:
        """Load the roster again; on any problem raise InvalidRoster and keep the last good one."""
        # Off the loop: the path may come from a client, and a large or slow file would stall it.
        roster = await asyncio.to_thread(_loaded, path or self.roster_path)
        self._roster = roster
        old = self._router
        self._router = self._router_of(roster)
        self.engine.router = self._router
        self.engine.set_roster(roster)
        self.gateway.set_roster(roster)
        await self.pool.reload(roster)
        if old is not None and old.embeddings is not None:
            old.embeddings.close()
        if self._router.embeddings is not None:  # its member leases from the reloaded pool
            self._router.embeddings.start()
        await self._witness_command_policy(roster)
        reloaded = rec.RosterReload(
            lanes=len(roster.lanes), models=[m.name for m in roster.models], client=client
        )
        await self.ledger.append(actor=client, kind=reloaded.KIND, body=reloaded.written())
        return roster

    async def stop(self) -> None:
        await self.lag.stop()
        if self._warming is not None:  # a thread: it cannot be cancelled, so it ends first
            await asyncio.wait([self._warming])
        for loop in (self._snapshots, self._checkup, self._cosigning):
            if loop is not None:
                loop.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await loop
        if self._engine is not None:
            await self._engine.shutdown(self.settings.drain_s)
        if self._tracer is not None:
            tracer, self._tracer = self._tracer, None
            await asyncio.to_thread(tracer.shutdown)  # flushes the last spans (HTTP)
        if self._router is not None and self._router.embeddings is not None:
            await self._router.embeddings.aclose()
        if self._pool is not None:
            # Before the snapshot: stopping servers witnesses slot.stopped entries, and a
            # snapshot that covers the whole ledger makes the next start replay nothing.
            await self._pool.stop()
        if self._engine is not None and self._ledger is not None:
            try:
                await self.write_snapshot()
            except Exception:  # derived data: the next start replays the ledger instead
                log.exception("run snapshot failed")
        if self._ledger is not None:
            try:
                await self._ledger.checkpoint()
            except TallyError as err:  # e.g. a full disk: close still releases the ledger
                log.warning("final checkpoint failed: %s", err.message)
            await self._ledger.close()
            self._ledger = None

    async def _on_slot_event(self, event: SlotEvent) -> None:
        if self._ledger is None:
            return
        body = rec.slot_body(event.model_dump(mode="json"))
        await self._ledger.append(actor="pool", kind=body.KIND, body=body.written())

    async def _check_members(self, roster: Roster) -> None:
        """`tally doctor --no-spawn` at start-up: warnings in the log, nothing blocks."""
        from daemon.slots.checkup import check_roster

        try:
            checkup = await check_roster(
                roster,
                roster_dir=self.roster_path.parent,
                state_dir=self.settings.state_dir,
                spawn=False,
                complete=False,
            )
        except Exception:  # a check that breaks must not take the daemon with it
            log.exception("the start-up member check failed")
            return
        for member in checkup.members:
            for line in member.lines():
                log.warning("member check: %s", line)
        await self._check_agent_clis(roster)
        if checkup.ok:
            names = ", ".join(m.name for m in checkup.members)
            log.info("member check: all members ok (%s)", names)
        else:
            log.warning("member check: `tally doctor --roster %s` checks again", self.roster_path)

    async def _check_agent_clis(self, roster: Roster) -> None:
        """Agent-cli members at start-up: program and binds (nothing runs), warnings only."""
        from daemon.runs.agentcli import static_problem

        for member in (m for m in roster.models if m.agent_cli):
            policy, confinement = roster.policy.command, self.confinement()
            problem = await asyncio.to_thread(static_problem, member, policy, confinement)
            if problem is not None:
                log.warning("member check: %s: %s", member.name, problem)

    async def _snapshot_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.snapshot_interval_s)
            try:
                await self.write_snapshot()
            except Exception:  # derived data: logged, the next period retries
                log.exception("run snapshot failed")


_USAGE_KINDS = frozenset({k.REQUEST, k.MODEL_REPLY, GATEWAY_REPLY})


def _tokens(body: rec.ModelReply | rec.GatewayReply) -> int:
    """Prompt and completion tokens of a reply; a count below zero (no tally writes one)
    counts as none, so a record cannot give a client back its budget."""
    if body.usage is None:
        return 0
    counts = (body.usage.prompt_tokens, body.usage.completion_tokens)
    return sum(max(0, count or 0) for count in counts)


async def _first_since(ledger: Ledger, ts_us: int, end: int) -> int:
    """The first seq below `end` witnessed at or after `ts_us` (entries' times only grow)."""
    low, high = 0, end
    while low < high:
        middle = (low + high) // 2
        if (await ledger.get(middle)).ts < ts_us:
            low = middle + 1
        else:
            high = middle
    return low


def _said_if_failed(task: asyncio.Task[None]) -> None:
    err = None if task.cancelled() else task.exception()
    if isinstance(err, TallyError):
        log.warning("checkpoint key: %s (no checkpoint is signed until it is fixed)", err.message)
    elif err is not None:
        log.error("loading the checkpoint key failed", exc_info=err)


def _loaded(path: Path) -> Roster:
    """The roster at `path`; its problems as the daemon's error (what clients are answered)."""
    try:
        return load_roster(path)
    except RosterError as err:
        raise InvalidRoster(err.message, details=err.details) from None
