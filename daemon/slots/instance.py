"""One server of a member: a process it spawned, or the external URL it names; its slots.

Contract. An instance runs one lifecycle task at a time (`ensure_running`). A spawned server
is started from its argv template, is ready once `/health` answers 200 and `/props` gives its
slots, is watched (exit, hang, reported fault, idle unload) and is restarted with backoff by
its member's failure policy. An external server is never spawned or restarted: it serves while
it answers and, when it does not, is `unhealthy` and probed with backoff until it answers. Each
ready period is one *incarnation*; its `Slot`s are valid only while it lasts, and when it ends
every lease on them is told (`LeaseHolder.lose`) before the slots are forgotten.

An instance reaches its member only through `InstanceOwner` (the member's failure policy, its
free-slot book-keeping, its counters), so this module does not import the member's.

One piece past 500 lines because the spawned and external lifecycles share the watcher, the
slot drop and the stop path, and each reads and sets the same state (`state`, `incarnation`,
`_fault`, `_pending_lost`) under one rule: only the lifecycle task moves an instance between
ready and not-ready; `report_fault`, `check_soon` and `stop` only ask it to.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from typing import Any, Protocol

import aiohttp

from daemon import layout
from daemon.slots import states
from daemon.slots.context import PoolContext
from daemon.slots.digest import DigestMismatch
from daemon.slots.discovery import connection_problem, read_props, split_url
from daemon.slots.errors import ServerStartError
from daemon.slots.holder import LeaseHolder
from daemon.slots.process import ServerProcess, free_port, render_argv
from daemon.slots.records import EventKind, InstanceState, InstanceStatus, SlotEvent, StopReason
from roster import Member, resolve_model_path

log = logging.getLogger("tally.slots")


class InstanceOwner(Protocol):
    """The member as its instances, their slots and the leases on them see it."""

    restarts: int
    recoveries: int
    unready_failures: int
    last_error: str | None

    @property
    def name(self) -> str: ...
    @property
    def spec(self) -> Member: ...
    @property
    def ctx(self) -> PoolContext: ...
    @property
    def cooling(self) -> bool: ...
    @property
    def waiting(self) -> int: ...

    def add_slots(self, instance: Instance) -> None:
        """A server came up: its slots are free to lease."""

    def forget_slots(self, instance: Instance) -> None:
        """A server went: its slots leave the free list and the affinity map."""

    def release(self, slot: Slot) -> None:
        """A lease ended: the slot is free again (if its server still runs)."""

    def grow_queues(self) -> None:
        """Let the queues it serves start servers for their waiters (one of its is backing off)."""

    async def record_failure(self, instance: Instance, reason: str, fatal: bool) -> float | None:
        """The restart delay after a failure, or None when the member is now cooling down."""

    async def went_down(self, instance: Instance, reason: str) -> None:
        """An external server became unreachable."""


class Slot:
    """One `id_slot` of one incarnation of an instance; `lease` is its tenant, if any."""

    __slots__ = ("affinity", "id", "incarnation", "instance", "lease")

    def __init__(self, instance: Instance, slot_id: int) -> None:
        self.instance = instance
        self.id = slot_id
        self.incarnation = instance.incarnation
        self.affinity: str | None = None
        self.lease: LeaseHolder | None = None

    @property
    def alive(self) -> bool:
        return self.incarnation == self.instance.incarnation


class Instance:
    """One server of a member: spawned from its command, or the external URL it names."""

    def __init__(self, member: InstanceOwner, index: int) -> None:
        self.member = member
        self.ctx = member.ctx
        self.index = index
        self.state: InstanceState = "stopped"  # changed only through `enter`
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

    def enter(self, state: InstanceState) -> None:
        """The one way the state changes: checked against `states.TRANSITIONS`."""
        states.check(f"{self.member.name}/{self.index}", self.state, state)
        self.state = state

    def ensure_running(self) -> None:
        if self.task is None:
            self.enter("starting")
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

    async def emit(self, kind: EventKind, **detail: Any) -> None:
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
            self.enter("starting")
            self._fault = None
            started = time.monotonic()
            try:
                await self._start()
            except ServerStartError as err:
                await self._kill()
                tail = str(err.details.get("log_tail", ""))
                self.last_error = err.message
                log.warning("%s/%d: %s\n%s", self.member.name, self.index, err.message, tail)
                await self.emit("slot.failed", reason=err.message, log_tail=tail[-1500:])
                if not await self._after_failure(err.message, bool(err.details.get("fatal"))):
                    return
                continue
            self.enter("ready")
            self.last_used = time.monotonic()
            self.member.unready_failures = 0
            await self.emit(
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
            self.enter("cooldown")
            return False
        self.enter("backoff")
        self.member.grow_queues()  # waiters need not wait out the backoff if another can start
        self.restarts += 1
        self.member.restarts += 1
        await self.emit("slot.restarting", delay_ms=int(delay * 1000), restarts=self.restarts)
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
        log_path = (
            self.ctx.state_dir / layout.LOGS / layout.server_log(self.member.name, self.index)
        )
        self.process = ServerProcess(argv, log_path)
        try:
            await self.process.spawn()
        except OSError as err:
            raise ServerStartError(
                f"cannot start {argv[0]}: {err}", details={"fatal": True}
            ) from None
        await self.emit("slot.starting", argv=argv, pid=self.process.pid, log=str(log_path))
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
        probe_base_s, doubling up to probe_max_s, until it answers; then it serves again.
        A server that went down while serving is held down before its first probe (the
        hold doubles while it keeps failing soon after each return)."""
        spec = self.member.spec
        assert spec.url is not None
        opts = self.ctx.options
        self.root_url, v1 = split_url(spec.url)
        self.port = None
        self.chat_url = v1 + "/chat/completions"
        self.headers = self._auth_headers()
        await self.emit("slot.starting", url=spec.url)
        delay, hold = opts.probe_base_s, 0.0
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
            up = time.monotonic()
            reason = await self._watch()
            lost = self._pending_lost + self._drop_slots(reason)
            self._pending_lost = 0
            # Hold-down before the next probe: a server that fails calls while its /health
            # still answers 200 would otherwise be ready again at once and fail the next call.
            # One that fails again soon after coming back is held twice as long each time.
            flapping = time.monotonic() - up < opts.probe_max_s
            hold = min(opts.probe_max_s, hold * 2) if flapping and hold else opts.probe_base_s
            await self._went_down(reason, lost, hold)
            self.next_probe = time.monotonic() + hold
            await asyncio.sleep(hold)

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
        self.enter("ready")
        self._fault = None
        self.last_used = time.monotonic()
        if was_down is None:
            await self.emit(
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
            await self.emit(
                "slot.recovered",
                slots=len(self.slots),
                n_ctx=self.n_ctx,
                down_ms=int((time.monotonic() - was_down) * 1000),
                last_error=self.last_error,
            )
        self.member.add_slots(self)

    async def _went_down(self, reason: str, lost: int, next_probe_s: float) -> None:
        self.enter("unhealthy")
        self.down_since = time.monotonic()
        self.last_error = reason
        log.warning("%s/%d: unhealthy: %s", self.member.name, self.index, reason)
        await self.emit(
            "slot.unhealthy",
            reason=reason,
            url=self.member.spec.url,
            next_probe_ms=int(next_probe_s * 1000),
        )
        if lost:
            await self.emit("slot.lost", reason=reason, leases=lost)
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
        self.member.forget_slots(self)
        for slot in self.slots:
            if slot.lease is not None:
                slot.lease.lose(reason)
                lost += 1
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
        await self.emit("slot.exited", reason=reason, returncode=code, log_tail=tail)
        if lost:
            await self.emit("slot.lost", reason=reason, leases=lost)

    async def _unload(self) -> None:
        idle_ms = int((time.monotonic() - self.last_used) * 1000)
        self.enter("stopping")
        self._drop_slots("unloaded")
        if self.process is not None:
            await self.process.terminate(self.ctx.options.stop_grace_s)
        self.enter("stopped")
        await self.emit("slot.unloaded", idle_ms=idle_ms)

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
        self.enter("stopping")
        lost = self._drop_slots(message)
        code: int | None = None
        if self.process is not None and self.process.returncode is None:
            code = await self.process.terminate(self.ctx.options.stop_grace_s)
        self.enter(state)
        if lost:
            await self.emit("slot.lost", reason=message, leases=lost)
        if was != "stopped":
            await self.emit(
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
