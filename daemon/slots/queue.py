"""Waiting for a slot: the bounded, fair queues of lease requests and their admission.

Contract. A lease target (a member, or a tier shared by its members) has one `WaitQueue`.
Admission of a request is, in order: a free slot at once when nobody of that target waits
(`grab`: no await, the fast path); else a place in the queue (`wait`), refused at once when
the queue is full (`PoolBusy`), or when no member can serve (`NoHealthyMember`, naming each
member and why); a waiter's absolute `time.monotonic()` deadline ends its wait (`PoolTimeout`).
Fairness: keys are (priority, pool-wide arrival number), lower first, so a member freeing a
slot compares the heads of every queue it serves and grants the earliest: FIFO within a
priority holds across a tier, whichever member frees a slot first. A waiter that gives up
(deadline, cancel) is uncounted, or hands back a slot granted meanwhile.

A queue reaches its members only through `QueueMember`, so this module does not import the
member's; members import it (each owns its queue and dispatches to the queues it serves).
"""

from __future__ import annotations

import asyncio
import heapq
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from daemon.slots.context import PoolContext
from daemon.slots.errors import NoHealthyMember, PoolBusy, PoolTimeout, SlotLost
from daemon.slots.instance import Slot
from roster import Member


class QueueMember(Protocol):
    """A member as the queues it serves see it: whether it can serve, its free slots, growth."""

    @property
    def name(self) -> str: ...
    @property
    def spec(self) -> Member: ...
    @property
    def queue(self) -> WaitQueue: ...
    @property
    def available(self) -> bool: ...
    @property
    def retiring(self) -> bool: ...
    @property
    def affinity(self) -> dict[str, Slot]: ...
    @property
    def free(self) -> dict[Slot, None]: ...

    def pick(self, affinity: str | None) -> Slot | None:
        """A free slot, the affinity key's own first; None when none is free."""

    def take(self, slot: Slot, affinity: str | None) -> None:
        """Mark a free slot leased (and the affinity key's)."""

    def pending_slots(self) -> int:
        """Slots expected soon from servers that are starting."""

    def can_grow(self) -> bool:
        """It has an instance that is not running and could start."""

    def active_instances(self) -> int: ...

    def start_instance(self) -> None: ...

    def why(self) -> str:
        """Why it takes no lease now."""

    def retry_after(self) -> float: ...

    def unavailable_error(self) -> NoHealthyMember: ...


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
    """The waiting leases of one target (a member, or a tier shared by its members)."""

    __slots__ = (
        "ctx",
        "failovers",
        "heap",
        "in_flight_failovers",
        "members",
        "name",
        "next_rung",
        "queued",
    )

    def __init__(self, ctx: PoolContext, name: str, members: Sequence[QueueMember]) -> None:
        self.ctx = ctx
        self.name = name
        self.members = members
        self.heap: list[Waiter] = []
        self.queued = 0
        # a tier's: the next tier of the ladder, where its leases go when it cannot serve
        self.next_rung: WaitQueue | None = None
        self.failovers = 0
        self.in_flight_failovers = 0  # calls moved off a member that failed under them

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

    def live(self) -> list[QueueMember]:
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

    # --- admission -------------------------------------------------------------------------

    def grab(self, affinity: str | None) -> Slot | None:
        """A free slot at once (the fast path: no await), or None; NoHealthyMember if no
        member of the queue can serve. The slot is taken: the caller leases it."""
        members = self.members
        if len(members) == 1:
            member = members[0]
            if not member.available:
                raise (
                    member.unavailable_error() if self is member.queue else self.unavailable_error()
                )
            if self.queued == 0:
                slot = member.pick(affinity)
                if slot is not None:
                    member.take(slot, affinity)
                    return slot
        else:
            live = [m for m in members if m.available]
            if not live:
                raise self.unavailable_error()
            if self.queued == 0:
                # a member with a free slot has nobody waiting (release dispatches at once)
                found = _free_slot(live, affinity)
                if found is not None:
                    member, slot = found
                    member.take(slot, affinity)
                    return slot
        return None

    async def wait(
        self, priority: int, deadline: float | None, affinity: str | None, max_queue: int
    ) -> Slot:
        """Queue for a slot of this queue's members (starting servers for it) until granted;
        `max_queue` bounds the waiters per member (a tier holds as many as their queues)."""
        target = self.name
        if deadline is not None and deadline <= time.monotonic():
            raise PoolTimeout(f"no slot of {target!r} before the deadline")
        if self.queued >= max_queue * len(self.members):
            raise PoolBusy(
                f"the queue of {target!r} is full ({self.queued} waiting)",
                details={"target": target, "queue": self.queued},
            )
        waiter = self.enqueue(priority, affinity)
        self.grow()
        try:
            if deadline is None:
                return await waiter.future
            async with asyncio.timeout_at(deadline):
                return await waiter.future
        except TimeoutError:
            self.forget(waiter)
            raise PoolTimeout(
                f"no slot of {target!r} before the deadline",
                details={"target": target},
            ) from None
        except BaseException:
            self.forget(waiter)
            raise

    async def elsewhere(
        self, failed: Mapping[str, str], priority: int, affinity: str | None, max_queue: int
    ) -> Slot:
        """A slot for a call that failed in flight on the members in `failed`: a free slot of
        another live member at once (the call was admitted already, so it does not queue
        behind newer ones), else a place in the first such member's own queue; SlotLost
        naming every member and why when no other member is live."""
        live = [m for m in self.live() if m.name not in failed]
        if not live:
            raise self.call_lost(failed)
        for member in live:
            slot = member.pick(affinity)
            if slot is not None:
                member.take(slot, affinity)
                return slot
        return await live[0].queue.wait(priority, None, affinity, max_queue)

    def call_lost(self, failed: Mapping[str, str]) -> SlotLost:
        """A call failed in flight and may not move (again): say what each member did."""
        why: dict[str, str] = {}
        for m in self.members:
            if m.name in failed:
                why[m.name] = f"failed in flight: {failed[m.name]}"
            elif m.available and not m.retiring:
                why[m.name] = "was not tried (a call moves to one other member only)"
            else:
                why[m.name] = m.why()
        return SlotLost(
            f"no member of {self.name!r} could finish the call: "
            + "; ".join(f"{name} {reason}" for name, reason in why.items()),
            details={"target": self.name, "members": why},
        )


def _free_slot(members: list[QueueMember], affinity: str | None) -> tuple[QueueMember, Slot] | None:
    """Within a tier: the affinity key's slot if it is free, else the first member's free slot
    (the roster's order)."""
    if affinity is not None:
        slot = members[0].affinity.get(affinity)
        if slot is not None:
            for owner in members:
                if slot in owner.free:  # only ever its own member's: free, and it serves here
                    return owner, slot
    for m in members:
        if m.free:
            slot = m.pick(affinity)
            if slot is not None:
                return m, slot
    return None
