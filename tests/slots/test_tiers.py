"""Tier leases across members: shared FIFO, work conservation, affinity, hand-over on
cooldown, and instances started on demand."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from daemon.slots import Pool, PoolBusy, PoolTimeout
from daemon.slots.lease import Lease
from roster import Member
from tests.slots.conftest import FAST, Events, PoolFactory, spawned
from tests.slots.fake_server import FakeServer


def ext(url: str, name: str, **kw: Any) -> Member:
    kw.setdefault("slots", 1)
    return Member(name=name, url=url, **kw)


def queue_of(pool: Pool, member: str) -> int:
    status = pool.status().member(member)
    assert status is not None
    return status.queue


class Grants:
    """Waiting leases whose grants are recorded in order, released one at a time."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.order: list[tuple[str, str]] = []  # (waiter name, member that served it)
        self.leases: dict[str, Lease] = {}
        self.tasks: list[asyncio.Future[None]] = []

    async def queue(self, name: str, target: str, priority: int = 0, **kw: Any) -> None:
        async def wait() -> None:
            lease = await self.pool.acquire(target, priority=priority, **kw)
            self.order.append((name, lease.member))
            self.leases[name] = lease

        self.tasks.append(asyncio.ensure_future(wait()))
        await asyncio.sleep(0)  # arrival order = call order

    async def settle(self) -> None:
        for _ in range(5):
            await asyncio.sleep(0)


async def test_tier_fifo_within_priority_across_members(
    fake: FakeServer, make_pool: PoolFactory
) -> None:
    pool = make_pool(ext(fake.url, "a"), ext(fake.url, "b"), tiers={"cheap": ["a", "b"]})
    held_a = await pool.acquire("a")
    held_b = await pool.acquire("b")
    grants = Grants(pool)
    await grants.queue("t1", "cheap", 5)
    await grants.queue("t2", "cheap", 1)
    await grants.queue("ma", "a", 1)  # member-targeted, between tier waiters
    await grants.queue("t3", "cheap", 1)
    await grants.queue("t4", "cheap", 5)
    status = pool.status()
    assert (queue_of(pool, "a"), queue_of(pool, "b")) == (1, 0)  # leases aimed at the member
    assert [(t.name, t.members, t.queue) for t in status.tiers] == [("cheap", ["a", "b"], 4)]
    assert status.queued == 5
    held_b.release()
    await grants.settle()
    held_a.release()
    await grants.settle()
    for name in ["t2", "ma", "t3", "t1"]:
        grants.leases[name].release()
        await grants.settle()
    await asyncio.gather(*grants.tasks)
    assert grants.order == [("t2", "b"), ("ma", "a"), ("t3", "b"), ("t1", "a"), ("t4", "b")]
    grants.leases["t4"].release()
    assert pool.status().queued == 0


async def test_tier_waiter_is_served_by_the_member_that_frees_first(
    fake: FakeServer, make_pool: PoolFactory
) -> None:
    pool = make_pool(ext(fake.url, "a"), ext(fake.url, "b"), tiers={"cheap": ["a", "b"]})
    held_a = await pool.acquire("cheap")
    held_b = await pool.acquire("cheap")
    assert (held_a.member, held_b.member) == ("a", "b")
    waiter = asyncio.ensure_future(pool.acquire("cheap"))
    await asyncio.sleep(0.01)
    held_b.release()  # the second member frees first: it serves the tier's waiter
    lease = await asyncio.wait_for(waiter, 1)
    assert lease.member == "b"
    lease.release()
    held_a.release()


async def test_member_waiter_is_not_served_by_another_member(
    fake: FakeServer, make_pool: PoolFactory
) -> None:
    pool = make_pool(ext(fake.url, "a"), ext(fake.url, "b"), tiers={"cheap": ["a", "b"]})
    held_a = await pool.acquire("a")
    held_b = await pool.acquire("b")
    waiter = asyncio.ensure_future(pool.acquire("a"))
    await asyncio.sleep(0.01)
    held_b.release()
    await asyncio.sleep(0.01)
    assert not waiter.done()
    held_a.release()
    lease = await asyncio.wait_for(waiter, 1)
    assert lease.member == "a"
    lease.release()


async def test_tier_affinity_prefers_the_lanes_slot_only_when_free(
    fake: FakeServer, make_pool: PoolFactory
) -> None:
    pool = make_pool(ext(fake.url, "a"), ext(fake.url, "b"), tiers={"cheap": ["a", "b"]})
    async with pool.lease("cheap", affinity="docs") as lease:
        assert lease.member == "a"
    (await pool.acquire("b")).release()  # b's server is up (its first lease waited for it)
    held = await pool.acquire("a")
    granted = asyncio.ensure_future(pool.acquire("cheap", affinity="docs"))
    await asyncio.sleep(0)  # one tick: granted from b's free slot, not queued for a's
    assert granted.done()
    lease = await granted
    assert lease.member == "b"
    lease.release()
    held.release()
    for _ in range(3):
        async with pool.lease("cheap", affinity="docs") as lease:
            assert lease.member == "b"  # its last slot, now on b
    async with pool.lease("cheap") as lease:
        assert lease.member == "a"  # a's slot is unclaimed again


async def test_tier_queue_bound_and_deadline(fake: FakeServer, make_pool: PoolFactory) -> None:
    pool = make_pool(
        ext(fake.url, "a"),
        ext(fake.url, "b"),
        tiers={"cheap": ["a", "b"]},
        options=FAST.model_copy(update={"max_queue": 2}),
    )
    held = [await pool.acquire("cheap"), await pool.acquire("cheap")]
    waiting = [asyncio.ensure_future(pool.acquire("cheap")) for _ in range(4)]  # 2 × 2 members
    await asyncio.sleep(0.01)
    refused = asyncio.ensure_future(pool.acquire("cheap"))
    await asyncio.sleep(0)  # refused at once: one loop tick, the queue unchanged
    assert refused.done()
    with pytest.raises(PoolBusy):
        await refused
    assert pool.status().queued == 4
    late = asyncio.ensure_future(pool.acquire("a", deadline=time.monotonic() + 0.1))
    with pytest.raises(PoolTimeout):
        await late  # a member's own queue has its own bound; the deadline still ends the wait
    for lease in held:
        lease.release()
    for fut in waiting:
        (await asyncio.wait_for(fut, 1)).release()
    held = [await pool.acquire("a"), await pool.acquire("b")]
    started = time.monotonic()
    with pytest.raises(PoolTimeout):
        await pool.acquire("cheap", deadline=time.monotonic() + 0.05)
    assert time.monotonic() - started >= 0.05  # not before its deadline
    with pytest.raises(PoolTimeout):
        await pool.acquire("cheap", deadline=time.monotonic() - 1)
    for lease in held:
        lease.release()
    assert pool.status().queued == 0


async def test_tier_waiters_move_to_a_healthy_member_on_cooldown(
    fake: FakeServer, make_pool: PoolFactory, events: Events
) -> None:
    bad = spawned("bad", "--model", "{model}", model="/nonexistent/model.gguf")
    pool = make_pool(ext(fake.url, "good"), bad, tiers={"cheap": ["good", "bad"]})
    held = await pool.acquire("good")
    waiter = asyncio.ensure_future(pool.acquire("cheap"))  # starts "bad", which cools down
    for _ in range(100):
        if "slot.cooldown" in events.kinds("bad"):
            break
        await asyncio.sleep(0.02)
    assert events.kinds("bad") == ["slot.failed", "slot.cooldown", "slot.failover"]
    failover = events[-1]
    assert failover.detail["tier"] == "cheap"
    assert failover.detail["to"] == ["good"]
    await asyncio.sleep(0.01)
    assert not waiter.done()  # handed over to "good", not failed
    held.release()
    lease = await asyncio.wait_for(waiter, 1)
    assert lease.member == "good"
    lease.release()
    with pytest.raises(PoolBusy):
        await pool.acquire("bad")  # a member-targeted lease still hears of the cooldown


async def test_tier_waiters_get_busy_when_every_member_cools_down(
    make_pool: PoolFactory, events: Events
) -> None:
    members = [
        spawned(name, "--model", "{model}", model="/nonexistent/model.gguf")
        for name in ("bad1", "bad2")
    ]
    pool = make_pool(*members, tiers={"cheap": ["bad1", "bad2"]})
    with pytest.raises(PoolBusy) as err:
        await asyncio.wait_for(pool.acquire("cheap"), 5)
    assert err.value.retry_after is not None
    assert err.value.retry_after >= 0.5
    assert sorted(e.member for e in events if e.kind == "slot.cooldown") == ["bad1", "bad2"]
    with pytest.raises(PoolBusy):
        await pool.acquire("cheap")  # at once while both cool down


async def test_instances_start_one_at_a_time_on_demand(
    fake: FakeServer, make_pool: PoolFactory, events: Events
) -> None:
    pool = make_pool(ext(fake.url, "m", instances=3))
    for _ in range(3):
        async with pool.lease("m"):
            pass
    starting = [e.instance for e in events if e.kind == "slot.starting"]
    assert starting == [0]  # one slot was enough: no idle instances
    status = pool.status().member("m")
    assert status is not None
    assert [i.state for i in status.instances] == ["ready", "stopped", "stopped"]
    held = await pool.acquire("m")
    second = await asyncio.wait_for(pool.acquire("m"), 2)  # queued: a second instance starts
    assert (held.instance, second.instance) == (0, 1)
    assert [e.instance for e in events if e.kind == "slot.starting"] == [0, 1]
    held.release()
    second.release()
    async with pool.lease("m") as lease:
        assert lease.instance in (0, 1)
    assert [e.instance for e in events if e.kind == "slot.starting"] == [0, 1]


async def test_tier_starts_members_only_for_unmet_demand(
    fake: FakeServer, make_pool: PoolFactory, events: Events
) -> None:
    pool = make_pool(ext(fake.url, "a", slots=2), ext(fake.url, "b"), tiers={"cheap": ["a", "b"]})
    first = await pool.acquire("cheap")
    second = await pool.acquire("cheap")
    assert (first.member, second.member) == ("a", "a")
    assert [e.member for e in events if e.kind == "slot.starting"] == ["a"]
    third = await asyncio.wait_for(pool.acquire("cheap"), 2)
    assert third.member == "b"
    for lease in (first, second, third):
        lease.release()


async def test_tier_waiters_are_served_by_a_member_back_from_cooldown(
    fake: FakeServer, make_pool: PoolFactory
) -> None:
    pool = make_pool(ext(fake.url, "a"), ext(fake.url, "b"), tiers={"cheap": ["a", "b"]})
    await pool.wait_ready("cheap")
    b = pool._members["b"]
    await b.instances[0].stop("cooldown", "injected", "cooldown")  # as if its server had failed
    await b.cool_down(b.instances[0], "injected")  # cooldown_s = 0.6 in FAST
    held = await pool.acquire("a")
    waiter = asyncio.ensure_future(pool.acquire("cheap"))
    await asyncio.sleep(0.2)
    assert not waiter.done()
    lease = await asyncio.wait_for(waiter, 3)  # "a" is still held: "b" came back for it
    assert lease.member == "b"
    lease.release()
    held.release()
