"""The slot pool: leases `(member, instance, id_slot)` of local model servers to tasks.

    pool = Pool(roster, state_dir, on_event=callback)
    await pool.start()
    async with pool.lease("cheap", priority=0, deadline=None, affinity="backend") as lease:
        result = await lease.chat(messages, max_tokens=256)
    await pool.stop()

A lease target is a tier (any of its members) or a member. Waiting callers queue per target,
lower priority number first and FIFO within a priority; a member freeing a slot serves the
earliest waiter of its own queue and its tiers' queues, so a tier's waiters are served in
order by whichever member frees a slot first (and by the others when one cools down). Each
queue is bounded (`PoolBusy` at once when full) and a caller's absolute `time.monotonic()`
deadline ends its wait (`PoolTimeout`). Servers start on demand, one instance at a time while
waiters outnumber the slots on their way, and unload after `idle_unload_s`.

Failover: a member that cools down, or an external member that stops answering, takes no
leases; its tiers' waiters go to the tier's other members. When no member of a tier can
serve, a lease aimed at the tier climbs the ladder to the next tier that can; when none can,
it fails at once with `NoHealthyMember`, naming every member and why. It never waits for a
server that is not there.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp

from daemon.slots.chat import ChatClient, Completion, OnChunk, OnDelta, request_body
from daemon.slots.digest import DigestCache
from daemon.slots.discovery import connection_problem
from daemon.slots.errors import (
    ModelError,
    NoHealthyMember,
    NoSuchTarget,
    PoolBusy,
    PoolTimeout,
    SlotLost,
)
from daemon.slots.member import MemberRuntime, PoolContext, PoolOptions, Slot, WaitQueue
from daemon.slots.records import ChatResult, PoolStatus, SlotEvent, TierStatus
from roster import Roster

log = logging.getLogger("tally.slots")

EventHook = Callable[[SlotEvent], Awaitable[None] | None]


class Lease:
    """One leased slot. `chat` talks to it; the slot returns to the pool when the lease ends."""

    __slots__ = ("_lost", "_member", "_released", "_slot", "_task", "id_slot", "instance", "member")

    def __init__(self, member: MemberRuntime, slot: Slot) -> None:
        self._member = member
        self._slot = slot
        self._lost: str | None = None
        self._released = False
        self._task: asyncio.Task[Any] | None = None
        self.member = member.name
        self.instance = slot.instance.index
        self.id_slot = slot.id
        slot.lease = self

    @property
    def server_url(self) -> str | None:
        """The server's root URL (for /slots, /metrics); None once it is gone."""
        return self._slot.instance.root_url if self._slot.alive else None

    @property
    def lost(self) -> str | None:
        return self._lost

    def lose(self, reason: str) -> None:
        """Called by the pool when the server under this lease died or hung."""
        self._lost = reason
        task = self._task
        if task is not None and not task.done():
            task.cancel()

    def _lost_error(self) -> SlotLost:
        return SlotLost(
            f"slot {self.id_slot} of {self.member}/{self.instance} was lost: {self._lost}",
            details={"member": self.member, "instance": self.instance, "id_slot": self.id_slot},
        )

    def request(
        self,
        messages: list[dict[str, Any]],
        max_tokens: int = 256,
        response_format: dict[str, Any] | None = None,
        *,
        stream: bool = False,
    ) -> dict[str, Any]:
        """The exact body `chat` sends for these arguments, so a caller can witness it first."""
        spec = self._member.spec
        return request_body(
            spec,
            self.id_slot if self._slot.instance.send_id_slot else None,
            messages,
            max_tokens=max_tokens,
            response_format=response_format,
            # llama.cpp notices a closed connection only while streaming (a non-streamed
            # request was measured generating on after its client left), so cancel can only
            # stop a server we own if we stream; the caller still gets one ChatResult.
            stream=stream or spec.url is None,
        )

    async def chat(
        self,
        messages: list[dict[str, Any]],
        max_tokens: int = 256,
        response_format: dict[str, Any] | None = None,
        on_delta: OnDelta | None = None,
        extra: dict[str, Any] | None = None,
    ) -> ChatResult:
        """POST /v1/chat/completions on this slot; streams (SSE) when `on_delta` is given."""
        body = self.request(messages, max_tokens, response_format, stream=on_delta is not None)
        if extra:
            body.update(extra)
        done = await self.send(body, on_delta=on_delta)
        return ChatResult(
            text=done.text,
            finish_reason=done.finish_reason,
            usage=done.usage,
            timings=done.timings,
            member=self.member,
            instance=self.instance,
            id_slot=self.id_slot,
            request=body,
            model=done.model,
            remote=done.remote,
        )

    def relay_body(self, body: dict[str, Any]) -> dict[str, Any]:
        """A client's own request body as this slot's server gets it: the member's model id,
        the slot pinned and its cache kept; a server tally spawns is always streamed (see
        `request`), and a stream always reports usage (the ledger meters it)."""
        spec = self._member.spec
        sent = dict(body)
        for key, value in spec.sampling.model_dump(exclude_none=True).items():
            sent.setdefault(key, value)  # the member's defaults; the client's values win
        sent["model"] = spec.model_id or spec.name
        sent["cache_prompt"] = True
        if self._slot.instance.send_id_slot:
            sent["id_slot"] = self.id_slot
        if sent.get("stream") or spec.url is None:
            sent["stream"] = True
            sent["stream_options"] = {**(sent.get("stream_options") or {}), "include_usage": True}
        return sent

    async def embed(self, body: dict[str, Any]) -> dict[str, Any]:
        """POST /v1/embeddings on this slot's server with the member's model id."""
        instance = self._slot.instance
        spec = self._member.spec
        url = instance.chat_url.removesuffix("/chat/completions") + "/embeddings"
        sent = {**body, "model": spec.model_id or spec.name}
        try:
            async with asyncio.timeout(spec.request_timeout_s):
                return await instance.ctx.client.post_json(url, sent, instance.headers)
        except (TimeoutError, aiohttp.ClientError) as err:
            raise SlotLost(
                f"embeddings on {self.member}/{self.instance} failed: {err!r}",
                details={"member": self.member, "instance": self.instance},
            ) from None

    async def send(
        self,
        body: dict[str, Any],
        *,
        on_delta: OnDelta | None = None,
        on_chunk: OnChunk | None = None,
    ) -> Completion:
        """POST `body` as is to this slot's server; faults become SlotLost (see `chat`)."""
        if self._lost is not None:
            raise self._lost_error()
        if self._released:
            raise RuntimeError("the lease has ended")
        instance = self._slot.instance
        spec = self._member.spec
        task = asyncio.current_task()
        self._task = task
        try:
            async with asyncio.timeout(spec.request_timeout_s):
                return await instance.ctx.client.complete(
                    instance.chat_url, body, instance.headers, on_delta, on_chunk
                )
        except asyncio.CancelledError:
            # Our own cancel from lose() becomes SlotLost; a caller's cancel stays a cancel.
            if self._lost is not None and task is not None and task.cancelling() <= 1:
                task.uncancel()
                raise self._lost_error() from None
            raise
        except TimeoutError:
            self._task = None
            self._lost = f"hung: no reply within {spec.request_timeout_s:g} s"
            instance.report_fault(self._lost)
            raise self._lost_error() from None
        except aiohttp.ClientError as err:
            self._task = None
            if self._lost is None:
                if isinstance(err, aiohttp.ClientConnectorError):  # nobody there (refused, …)
                    self._lost = connection_problem(err, instance.chat_url, 0)
                    instance.report_fault(self._lost)
                else:
                    self._lost = f"connection failed: {err!r}"
                    if spec.url is None:  # a loopback server we own does not drop connections
                        instance.report_fault(self._lost)
                    else:  # an external one may (a proxy, a restart): is it still there?
                        instance.check_soon()
            raise self._lost_error() from None
        except ModelError as err:
            if err.status_code >= 500 and spec.url is not None:
                instance.check_soon()  # a bad request or a server going away: a probe tells
            raise
        finally:
            self._task = None

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._member.release(self._slot)


class _LeaseContext:
    __slots__ = ("_affinity", "_deadline", "_lease", "_pool", "_priority", "_target")

    def __init__(
        self, pool: Pool, target: str, priority: int, deadline: float | None, affinity: str | None
    ) -> None:
        self._pool = pool
        self._target = target
        self._priority = priority
        self._deadline = deadline
        self._affinity = affinity
        self._lease: Lease | None = None

    async def __aenter__(self) -> Lease:
        self._lease = await self._pool.acquire(
            self._target, self._priority, self._deadline, self._affinity
        )
        return self._lease

    async def __aexit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._lease is not None:
            self._lease.release()


class Pool:
    def __init__(
        self,
        roster: Roster,
        state_dir: Path | str,
        on_event: EventHook | None = None,
        options: PoolOptions | None = None,
    ) -> None:
        self.roster = roster
        self.state_dir = Path(state_dir)
        self.options = options or PoolOptions()
        self._on_event = on_event
        self._ctx = PoolContext(
            options=self.options,
            state_dir=self.state_dir,
            client=ChatClient(),
            emit=self._emit,
            digests=DigestCache(self.state_dir),
        )
        self._members: dict[str, MemberRuntime] = {
            m.name: MemberRuntime(self._ctx, m) for m in roster.models
        }
        self._retired: list[MemberRuntime] = []
        self._tiers: dict[str, WaitQueue] = {}
        self._targets = self._index()
        self._stopping = False

    def _index(self) -> dict[str, WaitQueue]:
        """Targets → queues; a tier's queue survives a reload (with its waiters) if it stays."""
        targets = {name: m.queue for name, m in self._members.items()}
        for member in self._members.values():
            member.queues = [member.queue]
        tiers: dict[str, WaitQueue] = {}
        for tier, names in self.roster.tiers.members.items():
            found = [self._members[n] for n in names if n in self._members]
            if not found:
                continue
            queue = self._tiers.pop(tier, None) or WaitQueue(self._ctx, tier, found)
            queue.members = found
            for member in found:
                member.queues.append(queue)
            tiers[tier] = targets[tier] = queue
        for gone in self._tiers.values():
            gone.fail(PoolBusy(f"tier {gone.name!r} left the roster; retry"))
        ladder = [tiers[t] for t in self.roster.tiers.ladder if t in tiers]
        for queue in tiers.values():
            queue.next_rung = None
        for lower, upper in itertools.pairwise(ladder):
            lower.next_rung = upper
        self._tiers = tiers
        for queue in tiers.values():
            queue.grow()
        return targets

    async def start(self) -> None:
        """Prepare the state dir; servers start lazily, on their member's first lease."""
        (self.state_dir / "logs").mkdir(parents=True, exist_ok=True)
        self._stopping = False

    def lease(
        self,
        target: str,
        priority: int = 0,
        deadline: float | None = None,
        affinity: str | None = None,
    ) -> _LeaseContext:
        return _LeaseContext(self, target, priority, deadline, affinity)

    async def acquire(
        self,
        target: str,
        priority: int = 0,
        deadline: float | None = None,
        affinity: str | None = None,
    ) -> Lease:
        """Take a slot (the caller must `release()` the lease); `lease()` is the usual way.

        A tier none of whose members can serve hands the lease to the ladder's next tier
        (`failovers` counts it); a member has no such fallback.
        """
        queue = self._targets.get(target)
        if queue is None:
            raise NoSuchTarget(f"no tier or member named {target!r}", details={"target": target})
        if self._stopping:
            raise PoolBusy("the pool is stopping")
        tried: list[NoHealthyMember] = []  # the rungs that could not serve, in order
        rung: WaitQueue | None = queue
        while rung is not None:
            try:
                lease = self._grab(rung, affinity) or await self._wait(
                    rung, priority, deadline, affinity
                )
            except NoHealthyMember as err:
                tried.append(err)
                rung = rung.next_rung  # a member's queue has none
                continue
            if tried:
                queue.failovers += 1
            return lease
        if len(tried) == 1:
            raise tried[0]
        why = {n: r for err in tried for n, r in err.details.get("members", {}).items()}
        raise NoHealthyMember(
            f"no member can serve {target!r} or a tier above it: "
            + "; ".join(f"{name} {reason}" for name, reason in why.items()),
            retry_after=min(err.retry_after for err in tried),
            details={"target": target, "members": why},
        )

    def try_acquire(self, target: str, affinity: str | None = None) -> Lease | None:
        """A free slot of `target` at once, or None (nobody waits; no server starts)."""
        queue = self._targets.get(target)
        if queue is None:
            raise NoSuchTarget(f"no tier or member named {target!r}", details={"target": target})
        if self._stopping:
            raise PoolBusy("the pool is stopping")
        try:
            return self._grab(queue, affinity)
        except NoHealthyMember:
            return None  # `acquire` climbs the ladder or explains

    def _grab(self, queue: WaitQueue, affinity: str | None) -> Lease | None:
        """A free slot at once (the fast path: no await), or None; NoHealthyMember if no
        member of the queue can serve."""
        members = queue.members
        if len(members) == 1:
            member = members[0]
            if not member.available:
                raise (
                    member.unavailable_error()
                    if queue is member.queue
                    else queue.unavailable_error()
                )
            if queue.queued == 0:
                slot = member.pick(affinity)
                if slot is not None:
                    member.take(slot, affinity)
                    return Lease(member, slot)
        else:
            live = [m for m in members if m.available]
            if not live:
                raise queue.unavailable_error()
            if queue.queued == 0:
                # a member with a free slot has nobody waiting (release dispatches at once)
                found = _free_slot(live, affinity)
                if found is not None:
                    member, slot = found
                    member.take(slot, affinity)
                    return Lease(member, slot)
        return None

    async def _wait(
        self, queue: WaitQueue, priority: int, deadline: float | None, affinity: str | None
    ) -> Lease:
        """Queue for a slot of `queue`'s members (starting servers for it) until granted."""
        target = queue.name
        members = queue.members
        if deadline is not None and deadline <= time.monotonic():
            raise PoolTimeout(f"no slot of {target!r} before the deadline")
        # a tier holds as many waiters as its members' own queues would
        if queue.queued >= self.options.max_queue * len(members):
            raise PoolBusy(
                f"the queue of {target!r} is full ({queue.queued} waiting)",
                details={"target": target, "queue": queue.queued},
            )
        waiter = queue.enqueue(priority, affinity)
        queue.grow()
        try:
            if deadline is None:
                slot = await waiter.future
            else:
                async with asyncio.timeout_at(deadline):
                    slot = await waiter.future
        except TimeoutError:
            queue.forget(waiter)
            raise PoolTimeout(
                f"no slot of {target!r} before the deadline",
                details={"target": target},
            ) from None
        except BaseException:
            queue.forget(waiter)
            raise
        return Lease(slot.instance.member, slot)

    def status(self) -> PoolStatus:
        tiers = [
            TierStatus(
                name=q.name,
                members=[m.name for m in q.members],
                queue=q.queued,
                max_queue=self.options.max_queue * len(q.members),
                healthy=[m.name for m in q.live()],
                failovers=q.failovers,
            )
            for q in self._tiers.values()
        ]
        return PoolStatus(members=[m.status() for m in self._members.values()], tiers=tiers)

    async def wait_ready(self, target: str, timeout_s: float = 60.0) -> None:
        """Start a target's members and wait until one slot of each could be leased."""
        queue = self._targets.get(target)
        for member in queue.members if queue is not None else []:
            async with self.lease(member.name, deadline=time.monotonic() + timeout_s):
                pass

    async def stop(self) -> None:
        self._stopping = True
        for queue in self._tiers.values():
            queue.fail(PoolBusy("the pool is stopping"))
        members = [*self._members.values(), *self._retired]
        await asyncio.gather(*(m.stop("pool_stop", "pool stopped") for m in members))
        for task in list(self._ctx.tasks):
            task.cancel()
        await asyncio.gather(*self._ctx.tasks, return_exceptions=True)
        await self._ctx.client.close()

    async def reload(self, roster: Roster) -> None:
        """Adopt a new roster: new members start lazily; removed or changed ones stop when idle."""
        specs = {m.name: m for m in roster.models}
        for name, runtime in list(self._members.items()):
            if specs.get(name) == runtime.spec:
                continue
            del self._members[name]
            runtime.retiring = True
            runtime.queues = [runtime.queue]  # it serves no tier any more
            self._retired.append(runtime)
            runtime.queue.fail(PoolBusy(f"member {name!r} changed; retry"))
            if runtime.busy == 0:
                self._ctx.background(runtime.stop("retired", "removed from the roster"))
        for name, spec in specs.items():
            if name not in self._members:
                self._members[name] = MemberRuntime(self._ctx, spec)
        self.roster = roster
        self._targets = self._index()

    async def _emit(self, event: SlotEvent) -> None:
        log.info("%s %s/%d %s", event.kind, event.member, event.instance, event.detail)
        if self._on_event is None:
            return
        try:
            result = self._on_event(event)
            if inspect.isawaitable(result):
                await result
        except Exception:
            log.exception("the slot event hook failed on %s", event.kind)


def _free_slot(
    members: list[MemberRuntime], affinity: str | None
) -> tuple[MemberRuntime, Slot] | None:
    """Within a tier: the affinity key's slot if it is free, else the first member's free slot
    (the roster's order)."""
    if affinity is not None:
        slot = members[0].affinity.get(affinity)
        if slot is not None:
            owner = slot.instance.member
            if slot in owner.free and owner in members:
                return owner, slot
    for m in members:
        if m.free:
            slot = m.pick(affinity)
            if slot is not None:
                return m, slot
    return None
