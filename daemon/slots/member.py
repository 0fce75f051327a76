"""A pool member at run time: its instances (server processes or an external URL), their
slots, the member's waiting queue, and the fault handling (restart with backoff, cooldown,
idle unload; for an external server: unhealthy, probed with backoff, recovered).

Everything here runs on the event loop; the only shared state is plain attributes, so the
lease fast path (a free slot and nobody waiting) takes no lock and awaits nothing. It is one
file past 500 lines because slots, instances, members and queues hand each other slots and
waiters through those attributes: split apart, each would reach into the others' internals.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import os
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
from pydantic import BaseModel, ConfigDict

from daemon.slots.chat import ChatClient
from daemon.slots.digest import DigestCache, DigestMismatch
from daemon.slots.discovery import connection_problem, read_props, split_url
from daemon.slots.errors import NoHealthyMember, PoolBusy, ServerStartError
from daemon.slots.process import ServerProcess, free_port, render_argv
from daemon.slots.records import (
    EventKind,
    InstanceState,
    InstanceStatus,
    MemberStatus,
    SlotEvent,
    StopReason,
)
from roster import Member, resolve_model_path

if TYPE_CHECKING:
    from daemon.slots.pool import Lease

log = logging.getLogger("tally.slots")


class PoolOptions(BaseModel):
    """Timing and bounds of the pool; the defaults suit a workstation."""

    model_config = ConfigDict(frozen=True)

    max_queue: int = 256  # waiting leases per member (a tier: × its members); one more: PoolBusy
    backoff_base_s: float = 0.5  # first restart delay, doubled per failure in the window
    backoff_max_s: float = 30.0
    cooldown_after: int = 3  # failures within failure_window_s that cool a member down
    failure_window_s: float = 60.0
    cooldown_s: float = 30.0
    health_interval_s: float = 2.0
    health_timeout_s: float = 5.0
    health_failures: int = 3  # consecutive failed health checks that mean "hung"
    # An unreachable external server is probed again after probe_base_s, doubling up to
    # probe_max_s, until it answers: the bound on how late a recovery is noticed.
    probe_base_s: float = 1.0
    probe_max_s: float = 15.0
    ready_poll_s: float = 0.05
    stop_grace_s: float = 5.0
    log_max_bytes: int = 16 * 2**20  # a running server's log is rotated past this size
    host: str = "127.0.0.1"
    roster_dir: Path | None = None  # relative model paths resolve against it


@dataclass
class PoolContext:
    """What members share with the pool: options, the chat session, events, tasks."""

    options: PoolOptions
    state_dir: Path
    client: ChatClient
    emit: Callable[[SlotEvent], Awaitable[None]]
    digests: DigestCache
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)
    arrivals: Iterator[int] = field(default_factory=itertools.count)
    affinity: dict[str, Slot] = field(default_factory=dict)  # lane → the slot it used last

    def background(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)


class Slot:
    __slots__ = ("affinity", "id", "incarnation", "instance", "lease")

    def __init__(self, instance: Instance, slot_id: int) -> None:
        self.instance = instance
        self.id = slot_id
        self.incarnation = instance.incarnation
        self.affinity: str | None = None
        self.lease: Lease | None = None

    @property
    def alive(self) -> bool:
        return self.incarnation == self.instance.incarnation


class Waiter:
    __slots__ = ("affinity", "future", "key", "popped", "queue")

    def __init__(
        self,
        queue: WaitQueue,
        key: tuple[int, int],
        affinity: str | None,
        future: asyncio.Future[Slot],
    ) -> None:
        self.queue = queue
        self.key = key
        self.affinity = affinity
        self.future = future
        self.popped = False

    def __lt__(self, other: Waiter) -> bool:
        return self.key < other.key


class WaitQueue:
    """The waiting leases of one target (a member, or a tier shared by its members).

    Keys are (priority, pool-wide arrival number), so a member freeing a slot can compare the
    heads of all the queues it serves and grant the earliest: FIFO within a priority holds
    across a tier, and whichever member frees a slot first serves the tier's head.
    """

    __slots__ = ("ctx", "failovers", "heap", "members", "name", "next_rung", "queued")

    def __init__(self, ctx: PoolContext, name: str, members: list[MemberRuntime]) -> None:
        self.ctx = ctx
        self.name = name
        self.members = members
        self.heap: list[Waiter] = []
        self.queued = 0
        # a tier's: the next tier of the ladder, where its leases go when it cannot serve
        self.next_rung: WaitQueue | None = None
        self.failovers = 0

    def head(self) -> Waiter | None:
        heap = self.heap
        while heap:
            waiter = heap[0]
            if not waiter.future.done():
                return waiter
            heapq.heappop(heap)  # timed out or cancelled; already uncounted
        return None

    def enqueue(self, priority: int, affinity: str | None) -> Waiter:
        future: asyncio.Future[Slot] = asyncio.get_running_loop().create_future()
        waiter = Waiter(self, (priority, next(self.ctx.arrivals)), affinity, future)
        heapq.heappush(self.heap, waiter)
        self.queued += 1
        return waiter

    def forget(self, waiter: Waiter) -> None:
        """A waiter gave up (deadline, cancel): uncount it, or return a slot granted meanwhile."""
        if not waiter.popped:
            waiter.popped = True
            self.queued -= 1
            if not waiter.future.done():
                waiter.future.cancel()
            return
        future = waiter.future
        if future.done() and not future.cancelled() and future.exception() is None:
            slot = future.result()
            slot.instance.member.release(slot)

    def live(self) -> list[MemberRuntime]:
        return [m for m in self.members if m.available and not m.retiring]

    def grow(self) -> None:
        """Start servers only for demand that the slots on their way do not cover: one
        instance at a time, members with the fewest running instances first."""
        if not self.queued:
            return
        live = self.live()
        need = self.queued - sum(m.pending_slots() for m in live)
        while need > 0:
            growable = [m for m in live if m.can_grow()]
            if not growable:
                return
            member = min(growable, key=lambda m: m.active_instances())
            member.start_instance()
            need -= member.spec.slots

    def unavailable_error(self) -> NoHealthyMember:
        """Every member is cooling down or unreachable: say which and why."""
        if len(self.members) == 1 and self.members[0].queue is self:
            return self.members[0].unavailable_error()
        why = {m.name: m.why() for m in self.members}
        return NoHealthyMember(
            f"no member of {self.name!r} can serve: "
            + "; ".join(f"{name} {reason}" for name, reason in why.items()),
            retry_after=min(m.retry_after() for m in self.members),
            details={"target": self.name, "members": why},
        )

    def member_down(self) -> None:
        """A member cooled down or became unreachable: the others take its share, or, with
        none left, the waiters hear why (and a tier's lease then climbs the ladder)."""
        if self.live():
            self.grow()
        else:
            self.fail(self.unavailable_error())

    def failover(self) -> dict[str, Any] | None:
        """Where this tier's leases go now that a member is down (for `slot.failover`)."""
        live = self.live()
        if live:
            return {"tier": self.name, "to": [m.name for m in live]}
        if self.next_rung is not None:
            return {"tier": self.name, "to_tier": self.next_rung.name}
        return None

    def fail(self, error: Exception) -> None:
        waiters, self.heap = self.heap, []
        for waiter in waiters:
            if not waiter.future.done():
                waiter.popped = True
                self.queued -= 1
                waiter.future.set_exception(error)


class Instance:
    """One server of a member: spawned from its command, or the external URL it names."""

    def __init__(self, member: MemberRuntime, index: int) -> None:
        self.member = member
        self.ctx = member.ctx
        self.index = index
        self.state: InstanceState = "stopped"
        self.process: ServerProcess | None = None
        self.port: int | None = None
        self.root_url: str | None = None
        self.chat_url = ""
        self.headers: dict[str, str] = {}
        self.slots: list[Slot] = []
        self.incarnation = 0
        self.n_ctx: int | None = None
        self.send_id_slot = True
        self.restarts = 0
        self.last_error: str | None = None
        self.task: asyncio.Task[None] | None = None
        self.busy = 0
        self.last_used = time.monotonic()
        self._fault: str | None = None
        self._pending_lost = 0
        self._check_now = False
        self._wake = asyncio.Event()
        self.down_since: float | None = None  # external and unreachable since then
        self.next_probe: float | None = None

    # --- lifecycle -------------------------------------------------------------------------

    def ensure_running(self) -> None:
        if self.task is None:
            self.state = "starting"
            self.task = asyncio.get_running_loop().create_task(self._lifecycle())

    def report_fault(self, reason: str) -> None:
        """A lease saw the server hang or vanish: the watcher kills and restarts it (or, for
        an external server, marks it unhealthy and probes it until it answers again)."""
        if self.state == "ready" and self._fault is None:
            self._fault = reason
            # no new grants from here on, and the other leases learn at once
            self._pending_lost += self._drop_slots(reason)
            self._wake.set()

    def check_soon(self) -> None:
        """A lease saw a sign of trouble (a 5xx, a dropped stream): health-check it now."""
        if self.state == "ready":
            self._check_now = True
            self._wake.set()

    async def _emit(self, kind: EventKind, **detail: Any) -> None:
        await self.ctx.emit(
            SlotEvent(
                kind=kind,
                member=self.member.name,
                instance=self.index,
                port=self.port,
                detail=detail,
            )
        )

    async def _lifecycle(self) -> None:
        try:
            if self.member.spec.url is not None:
                await self._serve_external()
            else:
                await self._serve_spawned()
        finally:
            if self.task is asyncio.current_task():
                self.task = None

    async def _serve_spawned(self) -> None:
        while True:
            self.state = "starting"
            self._fault = None
            started = time.monotonic()
            try:
                await self._start()
            except ServerStartError as err:
                await self._kill()
                tail = str(err.details.get("log_tail", ""))
                self.last_error = err.message
                log.warning("%s/%d: %s\n%s", self.member.name, self.index, err.message, tail)
                await self._emit("slot.failed", reason=err.message, log_tail=tail[-1500:])
                if not await self._after_failure(err.message, bool(err.details.get("fatal"))):
                    return
                continue
            self.state = "ready"
            self.last_used = time.monotonic()
            self.member.unready_failures = 0
            await self._emit(
                "slot.ready",
                slots=len(self.slots),
                n_ctx=self.n_ctx,
                pid=self.process.pid if self.process else None,
                ready_ms=int((time.monotonic() - started) * 1000),
            )
            self.member.add_slots(self)
            reason = await self._watch()
            if reason == "idle":
                await self._unload()
                return
            await self._fail(reason)
            if not await self._after_failure(reason, False):
                return

    async def _after_failure(self, reason: str, fatal: bool) -> bool:
        """Back off before the next start (True), or cool the member down (False)."""
        delay = await self.member.record_failure(self, reason, fatal)
        if delay is None:
            self.state = "cooldown"
            return False
        self.state = "backoff"
        for queue in self.member.queues:
            queue.grow()  # waiters need not wait out the backoff if another server can start
        self.restarts += 1
        self.member.restarts += 1
        await self._emit("slot.restarting", delay_ms=int(delay * 1000), restarts=self.restarts)
        await asyncio.sleep(delay)
        return True

    async def _start(self) -> None:
        opts = self.ctx.options
        spec = self.member.spec
        self.slots = []
        self.chat_url = await self._spawn() + "/chat/completions"
        self.headers = self._auth_headers()
        deadline = time.monotonic() + spec.ready_timeout_s
        while True:
            if self.process is not None and self.process.returncode is not None:
                raise ServerStartError(
                    f"server exited with code {self.process.returncode} while loading",
                    details={"log_tail": self.process.tail()},
                )
            if await self._probe_ready():
                break
            if time.monotonic() >= deadline:
                raise ServerStartError(
                    f"server not ready within {spec.ready_timeout_s:g} s",
                    details={"log_tail": self.process.tail() if self.process else ""},
                )
            await asyncio.sleep(opts.ready_poll_s)
        self.incarnation += 1
        total = self._total_slots
        self.slots = [Slot(self, i) for i in range(total)]

    def _auth_headers(self) -> dict[str, str]:
        env = self.member.spec.api_key_env
        if env and os.environ.get(env):
            return {"Authorization": f"Bearer {os.environ[env]}"}
        return {}

    async def _spawn(self) -> str:
        spec = self.member.spec
        assert spec.command is not None
        values: dict[str, str | int] = {
            "port": 0,
            "slots": spec.slots,
            "ctx": spec.ctx * spec.slots,  # llama-server's -c is the total, split across slots
        }
        if spec.model is not None:
            try:
                path = resolve_model_path(spec.model, base=self.ctx.options.roster_dir)
                if spec.model_sha256:
                    await asyncio.to_thread(self.ctx.digests.check, path, spec.model_sha256)
            except (FileNotFoundError, DigestMismatch) as err:
                raise ServerStartError(str(err), details={"fatal": True}) from None
            values["model"] = str(path)
        self.port = free_port(self.ctx.options.host)
        values["port"] = self.port
        self.root_url = f"http://{self.ctx.options.host}:{self.port}"
        argv = render_argv(spec.command, values)
        log_path = self.ctx.state_dir / "logs" / f"{self.member.name}-{self.index}.log"
        self.process = ServerProcess(argv, log_path)
        try:
            await self.process.spawn()
        except OSError as err:
            raise ServerStartError(
                f"cannot start {argv[0]}: {err}", details={"fatal": True}
            ) from None
        await self._emit("slot.starting", argv=argv, pid=self.process.pid, log=str(log_path))
        return self.root_url + "/v1"

    _total_slots: int = 1

    async def _probe_ready(self) -> bool:
        """A spawned server is ready when /health answers 200 and /props gives its slots."""
        assert self.root_url is not None
        spec = self.member.spec
        client = self.ctx.client
        timeout = self.ctx.options.health_timeout_s
        try:
            status, _ = await client.get(self.root_url + "/health", timeout, self.headers)
            if status != 200:
                return False
            status, props = await client.get(self.root_url + "/props", timeout, self.headers)
        except (aiohttp.ClientError, TimeoutError):
            return False
        total, n_ctx = read_props(props)
        if status != 200 or total is None:
            return False  # a spawned server must answer /props (llama-server does)
        if total != spec.slots:
            log.warning(
                "%s: roster says %d slots, the server reports %d; using %d",
                self.member.name, spec.slots, total, total,
            )  # fmt: skip
        if n_ctx is not None and n_ctx != spec.ctx:
            log.warning(
                "%s: roster says ctx %d per slot, the server reports %d; using %d",
                self.member.name, spec.ctx, n_ctx, n_ctx,
            )  # fmt: skip
        self._total_slots = total
        self.n_ctx = n_ctx
        return True

    # --- an external server: probed, never restarted ----------------------------------------

    async def _serve_external(self) -> None:
        """Serve while it answers. When it does not (refused, a 5xx, failed health checks),
        it is unhealthy: its slots go, its waiters fail over, and it is probed again after
        probe_base_s, doubling up to probe_max_s, until it answers; then it serves again."""
        spec = self.member.spec
        assert spec.url is not None
        opts = self.ctx.options
        self.root_url, v1 = split_url(spec.url)
        self.port = None
        self.chat_url = v1 + "/chat/completions"
        self.headers = self._auth_headers()
        await self._emit("slot.starting", url=spec.url)
        delay = opts.probe_base_s
        while True:
            started = time.monotonic()
            problem = await self._reach()
            if problem is not None:
                if self.state != "unhealthy":
                    await self._went_down(problem, 0, delay)
                else:
                    self.last_error = self.member.last_error = problem
                self.next_probe = time.monotonic() + delay
                await asyncio.sleep(delay)
                delay = min(opts.probe_max_s, delay * 2)
                continue
            delay = opts.probe_base_s
            await self._came_up(started)
            reason = await self._watch()
            lost = self._pending_lost + self._drop_slots(reason)
            self._pending_lost = 0
            await self._went_down(reason, lost, 0.0)

    async def _reach(self) -> str | None:
        """Probe until ready (None), unreachable (why), or loading past ready_timeout_s."""
        spec = self.member.spec
        deadline = time.monotonic() + spec.ready_timeout_s
        while True:
            problem, verdict = await self._probe_external()
            if verdict == "ok":
                return None
            if verdict != "loading":
                return problem
            if time.monotonic() >= deadline:
                return f"{problem}, still after {spec.ready_timeout_s:g} s"
            await asyncio.sleep(self.ctx.options.ready_poll_s)

    async def _probe_external(self, props: bool = True) -> tuple[str, str]:
        """(problem, verdict): verdict "ok", "loading" (503 on /health), "slow" (a timeout)
        or "down" (refused, an error status, no /health and no /v1/models)."""
        assert self.root_url is not None
        client = self.ctx.client
        timeout = self.ctx.options.health_timeout_s
        url = self.root_url + "/health"
        try:
            status, _ = await client.get(url, timeout, self.headers)
            if status in (404, 405):  # not a llama-server: an OpenAI-only endpoint
                url = self.chat_url[: -len("/chat/completions")] + "/models"
                status, _ = await client.get(url, timeout, self.headers)
        except TimeoutError as exc:
            return connection_problem(exc, url, timeout), "slow"
        except aiohttp.ClientError as exc:
            return connection_problem(exc, url, timeout), "down"
        if status == 503 and url.endswith("/health"):
            return f"{url} answered 503 (loading)", "loading"
        if status != 200:
            hint = " (unauthorized: check api_key_env)" if status in (401, 403) else ""
            return f"{url} answered {status}{hint}", "down"
        if props:
            await self._read_external_props()
        return "", "ok"

    async def _read_external_props(self) -> None:
        """/props is optional (llama.cpp has it): it says whether id_slot can be pinned."""
        assert self.root_url is not None
        spec = self.member.spec
        self._total_slots = spec.slots  # an external server's `slots` bounds our concurrency
        try:
            status, props = await self.ctx.client.get(
                self.root_url + "/props", self.ctx.options.health_timeout_s, self.headers
            )
        except (aiohttp.ClientError, TimeoutError):
            status, props = 0, None
        total, n_ctx = read_props(props) if status == 200 else (None, None)
        self.send_id_slot = total is not None and total >= spec.slots
        self.n_ctx = n_ctx

    async def _came_up(self, started: float) -> None:
        was_down = self.down_since
        self.down_since = self.next_probe = None
        self.incarnation += 1
        self.slots = [Slot(self, i) for i in range(self._total_slots)]
        self.state = "ready"
        self._fault = None
        self.last_used = time.monotonic()
        if was_down is None:
            await self._emit(
                "slot.ready",
                slots=len(self.slots),
                n_ctx=self.n_ctx,
                pid=None,
                ready_ms=int((time.monotonic() - started) * 1000),
            )
        else:
            self.member.recoveries += 1
            log.info("%s/%d: recovered: %s answers again", self.member.name, self.index,
                     self.root_url)  # fmt: skip
            await self._emit(
                "slot.recovered",
                slots=len(self.slots),
                n_ctx=self.n_ctx,
                down_ms=int((time.monotonic() - was_down) * 1000),
                last_error=self.last_error,
            )
        self.member.add_slots(self)

    async def _went_down(self, reason: str, lost: int, next_probe_s: float) -> None:
        self.state = "unhealthy"
        self.down_since = time.monotonic()
        self.last_error = reason
        log.warning("%s/%d: unhealthy: %s", self.member.name, self.index, reason)
        await self._emit(
            "slot.unhealthy",
            reason=reason,
            url=self.member.spec.url,
            next_probe_ms=int(next_probe_s * 1000),
        )
        if lost:
            await self._emit("slot.lost", reason=reason, leases=lost)
        await self.member.went_down(self, reason)

    # --- watching a ready server -------------------------------------------------------------

    async def _health_check(self) -> tuple[bool, str | None]:
        """(healthy, why it is down at once): an external server that refuses or answers an
        error status is down at once; a timeout (or a spawned server's failed check) counts
        towards health_failures."""
        if self.member.spec.url is not None:
            problem, verdict = await self._probe_external(props=False)
            return verdict == "ok", (problem if verdict == "down" else None)
        assert self.root_url is not None
        try:
            status, _ = await self.ctx.client.get(
                self.root_url + "/health", self.ctx.options.health_timeout_s, self.headers
            )
        except (aiohttp.ClientError, TimeoutError):
            return False, None
        return status == 200, None

    async def _watch(self) -> str:
        """Wait until the server exits, hangs, is reported faulty, or idles out; say which."""
        opts = self.ctx.options
        exit_task: asyncio.Task[int] | None = None
        if self.process is not None:
            exit_task = asyncio.get_running_loop().create_task(self.process.wait())
            exit_task.add_done_callback(lambda _: self._wake.set())
        failed_checks = 0
        idle_s = self.member.spec.idle_unload_s if self.process is not None else None
        next_health = time.monotonic() + opts.health_interval_s
        try:
            while True:
                if self._fault is not None:
                    return self._fault
                if exit_task is not None and exit_task.done():
                    return f"exited with code {exit_task.result()}"
                if self._check_now:
                    self._check_now = False
                    next_health = 0.0
                now = time.monotonic()
                if now >= next_health:
                    healthy, down = await self._health_check()
                    if down is not None:
                        return down
                    await self._rotate_log()
                    next_health = time.monotonic() + opts.health_interval_s
                    failed_checks = 0 if healthy else failed_checks + 1
                    if failed_checks >= opts.health_failures:
                        return f"hung: {failed_checks} health checks failed"
                    continue
                wait_s = next_health - now
                if idle_s is not None:
                    if self.busy == 0 and self.member.waiting == 0:
                        idle_left = self.last_used + idle_s - now
                        if idle_left <= 0:
                            return "idle"
                        wait_s = min(wait_s, idle_left)
                    else:
                        wait_s = min(wait_s, idle_s)
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(wait_s):
                        await self._wake.wait()
        finally:
            if exit_task is not None and not exit_task.done():
                exit_task.cancel()

    async def _rotate_log(self) -> None:
        process = self.process
        if process is None:
            return
        limit = self.ctx.options.log_max_bytes
        if await asyncio.to_thread(process.rotate_if_over, limit):
            log.info("%s/%d: rotated %s past %d bytes", self.member.name, self.index,
                     process.log_path, limit)  # fmt: skip

    async def _kill(self) -> int | None:
        if self.process is None:
            return None
        self.process.kill()
        return await self.process.wait()

    def _drop_slots(self, reason: str) -> int:
        """Forget this incarnation's slots; leases on them learn they were lost."""
        self.incarnation += 1
        lost = 0
        for slot in self.slots:
            self.member.free.pop(slot, None)
            if slot.affinity is not None and self.member.affinity.get(slot.affinity) is slot:
                del self.member.affinity[slot.affinity]
            if slot.lease is not None:
                slot.lease.lose(reason)
                lost += 1
        self.member.busy -= self.busy
        self.busy = 0
        self.slots = []
        return lost

    async def _fail(self, reason: str) -> None:
        self.last_error = reason
        self.member.last_error = reason
        lost = self._pending_lost + self._drop_slots(reason)  # before the kill: leases learn why
        self._pending_lost = 0
        code = await self._kill()
        tail = self.process.tail()[-1500:] if self.process else ""
        log.warning("%s/%d: %s", self.member.name, self.index, reason)
        await self._emit("slot.exited", reason=reason, returncode=code, log_tail=tail)
        if lost:
            await self._emit("slot.lost", reason=reason, leases=lost)

    async def _unload(self) -> None:
        idle_ms = int((time.monotonic() - self.last_used) * 1000)
        self.state = "stopping"
        self._drop_slots("unloaded")
        if self.process is not None:
            await self.process.terminate(self.ctx.options.stop_grace_s)
        self.state = "stopped"
        await self._emit("slot.unloaded", idle_ms=idle_ms)

    async def stop(
        self, reason: StopReason, message: str, state: InstanceState = "stopped"
    ) -> None:
        """Stop whatever is running (used by pool stop, cooldown and retirement); an instance
        that was not stopped already reports `slot.stopped` with the reason."""
        was = self.status().state
        task = self.task
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            self.task = None
        self.state = "stopping"
        lost = self._drop_slots(message)
        code: int | None = None
        if self.process is not None and self.process.returncode is None:
            code = await self.process.terminate(self.ctx.options.stop_grace_s)
        self.state = state
        if lost:
            await self._emit("slot.lost", reason=message, leases=lost)
        if was != "stopped":
            await self._emit(
                "slot.stopped", reason=reason, message=message, previous=was, returncode=code
            )

    def status(self) -> InstanceStatus:
        state = self.state
        if state == "cooldown" and not self.member.cooling:
            state = "stopped"
        return InstanceStatus(
            index=self.index,
            state=state,
            port=self.port,
            pid=self.process.pid if self.process and self.process.returncode is None else None,
            url=self.root_url,
            slots_total=len(self.slots),
            slots_busy=self.busy,
            slots_idle=len(self.slots) - self.busy,
            n_ctx=self.n_ctx,
            restarts=self.restarts,
            last_error=self.last_error,
        )


class MemberRuntime:
    """A member's instances, free slots, affinity map, waiting queue and failure history."""

    def __init__(self, ctx: PoolContext, spec: Member) -> None:
        self.ctx = ctx
        self.spec = spec
        self.name = spec.name
        self.instances = [Instance(self, i) for i in range(spec.instances)]
        self.free: dict[Slot, None] = {}
        # pool-wide, so a lane's last slot is one slot even when it moved between members
        self.affinity: dict[str, Slot] = ctx.affinity
        self.queue = WaitQueue(ctx, self.name, [self])
        # its own queue first, then those of the tiers it serves (the pool sets these)
        self.queues: list[WaitQueue] = [self.queue]
        self.busy = 0
        self.failures: deque[float] = deque()
        self.cooldown_until = 0.0
        self.restarts = 0
        self.last_error: str | None = None
        self.retiring = False
        self.downs = 0
        self.recoveries = 0
        self.unready_failures = 0  # failures since one of its servers was last ready
        self._cooled_timer: asyncio.TimerHandle | None = None

    @property
    def cooling(self) -> bool:
        return self.cooldown_until > time.monotonic()

    @property
    def down(self) -> bool:
        """An external member none of whose servers answers: one was found unreachable and
        none is ready or still on its first probe."""
        unhealthy = False
        for instance in self.instances:  # on the lease fast path: no allocation
            state = instance.state
            if state == "ready" or state == "starting":
                return False
            unhealthy = unhealthy or state == "unhealthy"
        return unhealthy

    @property
    def available(self) -> bool:
        """It can take a lease now, or once a server starts."""
        if self.cooldown_until and self.cooling:
            return False
        return self.spec.url is None or not self.down

    @property
    def waiting(self) -> int:
        """Waiters this member could serve: its own and its tiers'."""
        return sum(q.queued for q in self.queues)

    def active_instances(self) -> int:
        return sum(1 for i in self.instances if i.task is not None)

    def pending_slots(self) -> int:
        """Slots expected soon from instances that are starting (not those backing off)."""
        return sum(self.spec.slots for i in self.instances if i.state == "starting")

    def can_grow(self) -> bool:
        return any(i.task is None and i.state != "stopping" for i in self.instances)

    def start_instance(self) -> None:
        for instance in self.instances:
            if instance.task is None and instance.state != "stopping":
                instance.ensure_running()
                return

    # --- slots -----------------------------------------------------------------------------

    def pick(self, affinity: str | None) -> Slot | None:
        """A free slot: the affinity key's own slot if free, else one no key has claimed."""
        if not self.free:
            return None
        if affinity is not None:
            slot = self.affinity.get(affinity)
            if slot is not None and slot in self.free:
                return slot
        for slot in self.free:
            if slot.affinity is None:
                return slot
        return next(iter(self.free))

    def take(self, slot: Slot, affinity: str | None) -> None:
        del self.free[slot]
        slot.instance.busy += 1
        self.busy += 1
        if affinity is not None and slot.affinity != affinity:
            if slot.affinity is not None and self.affinity.get(slot.affinity) is slot:
                del self.affinity[slot.affinity]
            previous = self.affinity.get(affinity)
            if previous is not None:
                previous.affinity = None  # the lane moved on: that slot is unclaimed again
            slot.affinity = affinity
            self.affinity[affinity] = slot

    def release(self, slot: Slot) -> None:
        slot.lease = None
        if not slot.alive:
            return  # its server is gone; the slot went with it
        instance = slot.instance
        instance.busy -= 1
        self.busy -= 1
        instance.last_used = time.monotonic()
        self.free[slot] = None
        for queue in self.queues:
            if queue.queued:
                self.dispatch()
                break
        if self.retiring and self.busy == 0:
            self.ctx.background(self.stop("retired", "removed from the roster"))

    def add_slots(self, instance: Instance) -> None:
        for slot in instance.slots:
            self.free[slot] = None
        self.dispatch()

    def dispatch(self) -> None:
        """Hand free slots to the earliest (priority, arrival) waiter of any queue served."""
        if self.cooling:
            return  # its instances are being stopped; the tiers' other members serve
        queues = self.queues
        while self.free:
            best: Waiter | None = None
            for queue in queues:
                if queue.queued:
                    head = queue.head()
                    if head is not None and (best is None or head.key < best.key):
                        best = head
            if best is None:
                return
            queue = best.queue
            heapq.heappop(queue.heap)
            best.popped = True
            queue.queued -= 1
            slot = self.pick(best.affinity)
            assert slot is not None
            self.take(slot, best.affinity)
            best.future.set_result(slot)

    # --- faults ----------------------------------------------------------------------------

    async def record_failure(self, instance: Instance, reason: str, fatal: bool) -> float | None:
        """Count a failure; the restart delay, or None when the member is now cooling down."""
        opts = self.ctx.options
        now = time.monotonic()
        self.last_error = reason
        self.failures.append(now)
        while self.failures and self.failures[0] < now - opts.failure_window_s:
            self.failures.popleft()
        # Failures in a row without a ready server count too: a start that times out after
        # ready_timeout_s may be slower than the window, and must not retry forever.
        self.unready_failures += 1
        if (
            fatal
            or len(self.failures) >= opts.cooldown_after
            or self.unready_failures >= opts.cooldown_after
        ):
            self.unready_failures = 0
            await self.cool_down(instance, reason)
            return None
        return float(min(opts.backoff_max_s, opts.backoff_base_s * 2 ** (len(self.failures) - 1)))

    async def cool_down(self, instance: Instance, reason: str) -> None:
        opts = self.ctx.options
        self.cooldown_until = time.monotonic() + opts.cooldown_s
        failures = len(self.failures)
        self.failures.clear()
        log.error("%s: cooling down for %g s after: %s", self.name, opts.cooldown_s, reason)
        await instance._emit(
            "slot.cooldown",
            reason=reason,
            failures=failures,
            cooldown_ms=int(opts.cooldown_s * 1000),
        )
        self.queue.fail(self.unavailable_error())
        await self._fail_over(instance, reason)
        # tier waiters still queued then may need this member again
        if self._cooled_timer is not None:
            self._cooled_timer.cancel()
        self._cooled_timer = asyncio.get_running_loop().call_later(
            opts.cooldown_s + 0.01, self._cooled, instance
        )
        for other in self.instances:
            if other is not instance and (other.task is not None or other.slots):
                self.ctx.background(other.stop("cooldown", f"cooldown: {reason}", "cooldown"))

    def _cooled(self, instance: Instance) -> None:
        self._cooled_timer = None
        if self.cooling:
            return
        for other in self.instances:
            if other.state == "cooldown":
                other.state = "stopped"  # startable again, as status() already showed
        self.ctx.background(instance._emit("slot.cooldown_ended", last_error=self.last_error))
        if not self.retiring:
            self.dispatch()
            for queue in self.queues[1:]:
                queue.grow()

    def why(self) -> str:
        """Why it takes no lease (for errors that name every member of a target)."""
        if self.cooling:
            return f"is cooling down after repeated failures: {self.last_error}"
        if self.down:
            return f"is unreachable: {self.last_error}"
        return "is available"

    def retry_after(self) -> float:
        """Seconds until it may take leases again: the cooldown's end or the next probe."""
        now = time.monotonic()
        if self.cooling:
            return max(1.0, self.cooldown_until - now)
        probes = [i.next_probe for i in self.instances if i.next_probe is not None]
        return max(1.0, min(probes) - now) if probes else 1.0

    def unavailable_error(self) -> NoHealthyMember:
        remaining = self.retry_after()
        return NoHealthyMember(
            f"member {self.name!r} {self.why()}",
            retry_after=remaining,
            details={
                "member": self.name,
                "members": {self.name: self.why()},
                "retry_after_ms": int(remaining * 1000),
            },
        )

    async def went_down(self, instance: Instance, reason: str) -> None:
        """An external server became unreachable; with none left, the member is down: its
        waiters fail, and its tiers' leases go to their other members or the next rung."""
        self.last_error = reason
        if not self.down:
            return  # another of its servers still answers
        self.downs += 1
        self.queue.fail(self.unavailable_error())
        await self._fail_over(instance, reason)

    async def _fail_over(self, instance: Instance, reason: str) -> None:
        for queue in self.queues[1:]:
            where = queue.failover()
            queue.member_down()
            if where is not None:
                await instance._emit("slot.failover", reason=reason, **where)

    async def stop(self, reason: StopReason, message: str) -> None:
        if self._cooled_timer is not None:
            # a stopped member's cooldown does not "end": its instances report stopped instead
            self._cooled_timer.cancel()
            self._cooled_timer = None
        self.queue.fail(PoolBusy(f"member {self.name!r} is stopping ({message})"))
        await asyncio.gather(*(i.stop(reason, message) for i in self.instances))

    def status(self) -> MemberStatus:
        instances = [i.status() for i in self.instances]
        now = time.monotonic()
        downs = [i.down_since for i in self.instances if i.down_since is not None]
        probes = [i.next_probe for i in self.instances if i.next_probe is not None]
        if self.cooling:
            state = "cooldown"
        elif self.down:
            state = "unhealthy"
        elif any(i.state == "ready" for i in instances):
            state = "ready"
        elif any(i.state in ("starting", "backoff") for i in instances):
            state = "starting"
        elif any(i.state == "stopping" for i in instances):
            state = "stopping"
        else:
            state = "stopped"
        return MemberStatus(
            name=self.name,
            external=self.spec.external,
            state=state,
            queue=self.queue.queued,
            max_queue=self.ctx.options.max_queue,
            leases=self.busy,
            restarts=self.restarts,
            failures=len(self.failures),
            cooldown_remaining_ms=int(max(0.0, self.cooldown_until - time.monotonic()) * 1000),
            last_error=self.last_error,
            instances=instances,
            healthy=self.available,
            unhealthy_ms=int((now - min(downs)) * 1000) if self.down and downs else 0,
            next_probe_ms=int(max(0.0, min(probes) - now) * 1000) if probes else None,
            downs=self.downs,
            recoveries=self.recoveries,
        )
