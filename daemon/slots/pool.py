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
server that is not there. A call that fails in flight on a lease aimed at a tier moves once
to another member of that tier (`Lease.chat`), before its caller climbs the ladder.

The pool holds the roster's members and tiers and wires them together (targets, the ladder,
reloads); the parts live beside it: `member` (a member's slots and failure policy), `instance`
(one server), `queue` (waiting and admission), `lease` (what a caller holds), `options`.
Imports run one way (pool → member → queue → instance, and lease → instance); what a lower
module needs of a higher one is a protocol it declares (`InstanceOwner`, `QueueMember`,
`ports.LeaseHolder`).
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, KeysView
from pathlib import Path
from types import TracebackType

from daemon import layout
from daemon.slots.chat import ChatClient
from daemon.slots.context import PoolContext
from daemon.slots.digest import DigestCache
from daemon.slots.errors import ModelError, NoHealthyMember, NoSuchTarget, PoolBusy, SlotLost
from daemon.slots.instance import Slot
from daemon.slots.lease import Lease
from daemon.slots.member import MemberRuntime
from daemon.slots.options import PoolOptions
from daemon.slots.queue import QueueMember, WaitQueue
from daemon.slots.records import PoolStatus, SlotEvent, TierStatus
from roster import Roster

log = logging.getLogger("tally.slots")

EventHook = Callable[[SlotEvent], Awaitable[None] | None]


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
        # pool-wide, so a lane's last slot is one slot even when it moved between members
        self._affinity: dict[str, Slot] = {}
        self._members: dict[str, MemberRuntime] = {
            m.name: MemberRuntime(self._ctx, m, self._affinity)
            for m in roster.models
            if not m.agent_cli  # an agent CLI is run per task (daemon.runs.agentcli), never leased
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
            found: list[QueueMember] = [self._members[n] for n in names if n in self._members]
            if not found:
                continue
            queue = self._tiers.pop(tier, None) or WaitQueue(self._ctx, tier, found)
            queue.members = found
            for name in names:
                if name in self._members:
                    self._members[name].queues.append(queue)
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
        (self.state_dir / layout.LOGS).mkdir(parents=True, exist_ok=True)
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
                slot = rung.grab(affinity) or await rung.wait(
                    priority, deadline, affinity, self.options.max_queue
                )
            except NoHealthyMember as err:
                tried.append(err)
                rung = rung.next_rung  # a member's queue has none
                continue
            if tried:
                queue.failovers += 1
            if len(rung.members) > 1:  # a tier with another member to move a failed call to
                return Lease(slot, _TierFailover(self, rung, priority, affinity))
            return Lease(slot)
        if len(tried) == 1:
            raise tried[0]
        why = {n: r for err in tried for n, r in err.details.get("members", {}).items()}
        raise NoHealthyMember(
            f"no member can serve {target!r} or a tier above it: "
            + "; ".join(f"{name} {reason}" for name, reason in why.items()),
            retry_after=min(err.retry_after for err in tried),
            details={"target": target, "members": why},
        )

    def tiers(self) -> KeysView[str]:
        """The tiers with a member in the roster: the `tier:` targets a lease may name."""
        return self._tiers.keys()

    def try_acquire(self, target: str, affinity: str | None = None) -> Lease | None:
        """A free slot of `target` at once, or None (nobody waits; no server starts)."""
        queue = self._targets.get(target)
        if queue is None:
            raise NoSuchTarget(f"no tier or member named {target!r}", details={"target": target})
        if self._stopping:
            raise PoolBusy("the pool is stopping")
        try:
            slot = queue.grab(affinity)
        except NoHealthyMember:
            return None  # `acquire` climbs the ladder or explains
        return Lease(slot) if slot is not None else None

    def status(self) -> PoolStatus:
        tiers = [
            TierStatus(
                name=q.name,
                members=[m.name for m in q.members],
                queue=q.queued,
                max_queue=self.options.max_queue * len(q.members),
                healthy=[m.name for m in q.live()],
                failovers=q.failovers,
                in_flight_failovers=q.in_flight_failovers,
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
        specs = {m.name: m for m in roster.models if not m.agent_cli}
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
                self._members[name] = MemberRuntime(self._ctx, spec, self._affinity)
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


class _TierFailover:
    """A tier lease's way to move a call that failed in flight (see `Lease.chat`): once, to
    another live member of the tier that granted the slot, at the lease's own priority."""

    __slots__ = ("_affinity", "_pool", "_priority", "_rung")

    def __init__(self, pool: Pool, rung: WaitQueue, priority: int, affinity: str | None) -> None:
        self._pool = pool
        self._rung = rung
        self._priority = priority
        self._affinity = affinity

    @property
    def tier(self) -> str:
        return self._rung.name

    async def move(self, failed: dict[str, str], error: SlotLost | ModelError) -> Slot:
        rung = self._rung
        if self._pool._stopping:
            raise error
        if len(failed) > 1:  # it moved once already
            raise rung.call_lost(failed)
        slot = await rung.elsewhere(
            failed, self._priority, self._affinity, self._pool.options.max_queue
        )
        rung.in_flight_failovers += 1
        return slot
