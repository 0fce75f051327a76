"""A pool member at run time: its instances, its free slots, and its failure policy.

Contract. A member owns its instances (`instances`), the book of their free slots (`free`),
its own waiting queue (`queue`) and the tier queues it serves (`queues`, set by the pool). A
slot freed or a server come up is granted at once to the earliest (priority, arrival) waiter
of any queue it serves (`dispatch`). Failures are counted in a window: a spawned server
restarts with backoff, and `cooldown_after` failures (or as many starts in a row that never
got ready, or one fatal one) cool the member down for `cooldown_s`: it takes no lease, its own
waiters fail, its tiers' waiters go to the other members or the next rung, all witnessed
(`slot.cooldown`, `slot.failover`). An external member whose servers all stop answering is
`down` the same way, until a probe finds one again. It implements `InstanceOwner` (for its
instances) and `QueueMember` (for the queues it serves).

Everything here runs on the event loop and the shared state is plain attributes, so the
lease fast path (a free slot and nobody waiting) takes no lock and awaits nothing.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import time
from collections import deque

from daemon.slots.context import PoolContext
from daemon.slots.errors import NoHealthyMember, PoolBusy
from daemon.slots.instance import Instance, Slot
from daemon.slots.queue import Waiter, WaitQueue
from daemon.slots.records import MemberStatus, StopReason
from daemon.tls import client_ssl
from roster import Member

log = logging.getLogger("tally.slots")


class MemberRuntime:
    """A member's instances, free slots, affinity map, waiting queue and failure history."""

    def __init__(self, ctx: PoolContext, spec: Member, affinity: dict[str, Slot]) -> None:
        self.ctx = ctx
        self.spec = spec
        self.name = spec.name
        if spec.url is not None and (spec.tls_fingerprint or spec.tls_ca):
            ctx.client.pin(spec.url, client_ssl(spec.tls_fingerprint, spec.tls_ca))
        self.instances = [Instance(self, i) for i in range(spec.instances)]
        self.free: dict[Slot, None] = {}
        # pool-wide, so a lane's last slot is one slot even when it moved between members
        self.affinity = affinity
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

    def forget_slots(self, instance: Instance) -> None:
        for slot in instance.slots:
            self.free.pop(slot, None)
            if slot.affinity is not None and self.affinity.get(slot.affinity) is slot:
                del self.affinity[slot.affinity]
        self.busy -= instance.busy

    def grow_queues(self) -> None:
        for queue in self.queues:
            queue.grow()

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
        await instance.emit(
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
                other.enter("stopped")  # startable again, as status() already showed
        self.ctx.background(instance.emit("slot.cooldown_ended", last_error=self.last_error))
        if not self.retiring:
            self.dispatch()
            for queue in self.queues[1:]:
                queue.grow()

    def why(self) -> str:
        """Why it takes no lease (for errors that name every member of a target)."""
        if self.cooling:
            return f"is cooling down after repeated failures: {self.last_error}"
        if self.down:
            return f"is unreachable: {self._down_reason()}"
        return "is available"

    def _down_reason(self) -> str:
        # An instance turns unhealthy a moment before went_down() records the member's reason:
        # a lease in between reads the instance's own (never "None").
        found = self.last_error or next(
            (i.last_error for i in self.instances if i.last_error), None
        )
        return found or "its health check failed"

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
                await instance.emit("slot.failover", reason=reason, **where)

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
