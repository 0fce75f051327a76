"""External members: never restarted; unreachable means unhealthy at once, leases fail over
(to the tier's other members, then up the ladder), and a member that answers again is used
again. Real sockets throughout: a closed port, the fake server started on it later."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from daemon.slots import NoHealthyMember, PoolBusy, SlotLost
from daemon.slots.process import free_port
from tests.polling import until
from tests.slots.conftest import FAST, MSG, Events, PoolFactory, spawned
from tests.slots.conftest import single as ext
from tests.slots.fake_server import FakeServer


def closed_url() -> tuple[int, str]:
    port = free_port()  # bound and released: nothing listens there now
    return port, f"http://127.0.0.1:{port}/v1"


async def test_a_closed_port_is_unhealthy_at_once_never_restarted(
    make_pool: PoolFactory, events: Events
) -> None:
    _, url = closed_url()
    pool = make_pool(ext(url, "gone"))
    started = time.monotonic()
    with pytest.raises(NoHealthyMember) as err:
        await pool.acquire("gone")
    # At once: a refused connection is not waited on until the member's 60 s ready timeout
    # (the bound is generous: the suite runs on a loaded machine).
    assert time.monotonic() - started < 30
    assert "gone" in err.value.message
    assert "connection refused" in err.value.message
    assert err.value.details["members"]["gone"].startswith("is unreachable: cannot connect")
    assert isinstance(err.value, PoolBusy)  # callers that retry on busy wait retry_after
    assert events.kinds() == ["slot.starting", "slot.unhealthy"]
    with pytest.raises(NoHealthyMember):  # known down: no wait at all, so a deadline that
        await pool.acquire("gone", deadline=time.monotonic())  # passed is never reached
    assert events.kinds() == ["slot.starting", "slot.unhealthy"]  # and no new probe for it
    await asyncio.sleep(0.5)  # several probes later: still no restart, no failure loop
    kinds = set(events.kinds())
    assert not kinds & {"slot.restarting", "slot.failed", "slot.cooldown", "slot.exited"}
    status = pool.status().member("gone")
    assert status is not None
    assert (status.state, status.healthy, status.restarts, status.downs) == (
        "unhealthy",
        False,
        0,
        1,
    )
    assert status.unhealthy_ms >= 400
    assert status.last_error is not None
    assert "connection refused" in status.last_error


async def test_a_tier_fails_over_to_its_healthy_member(
    fake: FakeServer, make_pool: PoolFactory, events: Events
) -> None:
    _, url = closed_url()
    pool = make_pool(ext(url, "gone"), ext(fake.url, "good"), tiers={"cheap": ["gone", "good"]})
    async with pool.lease("cheap") as lease:  # "gone" is tried first (roster order), then not
        assert lease.member == "good"
        await lease.chat(MSG, max_tokens=1)
    failover = next(e for e in events if e.kind == "slot.failover")
    assert (failover.member, failover.detail["tier"], failover.detail["to"]) == (
        "gone",
        "cheap",
        ["good"],
    )
    tier = pool.status().tiers[0]
    assert tier.healthy == ["good"]
    for _ in range(3):
        async with pool.lease("cheap") as lease:
            assert lease.member == "good"


async def test_a_tier_with_no_healthy_member_climbs_the_ladder(
    fake: FakeServer, make_pool: PoolFactory, events: Events
) -> None:
    _, url = closed_url()
    pool = make_pool(
        ext(url, "gone"),
        ext(fake.url, "big"),
        tiers={"cheap": ["gone"], "capable": ["big"]},
    )
    async with pool.lease("cheap") as lease:
        assert lease.member == "big"
    failover = next(e for e in events if e.kind == "slot.failover")
    assert failover.detail == {
        "tier": "cheap",
        "to_tier": "capable",
        "reason": failover.detail["reason"],
    }
    async with pool.lease("cheap") as lease:  # known down: straight to the next rung
        assert lease.member == "big"
    cheap = next(t for t in pool.status().tiers if t.name == "cheap")
    assert (cheap.failovers, cheap.healthy) == (2, [])
    with pytest.raises(NoHealthyMember):
        await pool.acquire("gone")  # a member-targeted lease has no ladder


async def test_when_no_member_can_serve_the_error_names_each_and_why(
    make_pool: PoolFactory, events: Events
) -> None:
    _, url_a = closed_url()
    _, url_b = closed_url()
    pool = make_pool(ext(url_a, "a"), ext(url_b, "b"), tiers={"cheap": ["a"], "capable": ["b"]})
    started = time.monotonic()
    with pytest.raises(NoHealthyMember) as err:
        await pool.acquire("cheap")
    assert time.monotonic() - started < 30  # not the members' 60 s ready timeouts (generous)
    message = err.value.message
    assert "'cheap'" in message
    assert url_a.removesuffix("/v1") in message
    assert url_b.removesuffix("/v1") in message
    assert set(err.value.details["members"]) == {"a", "b"}


async def test_a_member_that_comes_back_is_used_again(
    make_pool: PoolFactory, events: Events
) -> None:
    port, url = closed_url()
    pool = make_pool(ext(url, "late"))
    with pytest.raises(NoHealthyMember):
        await pool.acquire("late")
    fake = FakeServer(slots=1)
    await fake.start(port)  # the same port, later
    try:
        await until(lambda: "slot.recovered" in events.kinds())
        async with pool.lease("late") as lease:
            result = await lease.chat(MSG, max_tokens=1)
        assert result.member == "late"
        recovered = next(e for e in events if e.kind == "slot.recovered")
        assert recovered.detail["down_ms"] > 0
        status = pool.status().member("late")
        assert status is not None
        assert (status.state, status.healthy, status.downs, status.recoveries) == (
            "ready",
            True,
            1,
            1,
        )
        assert status.unhealthy_ms == 0
    finally:
        await fake.stop()


async def test_a_server_that_goes_away_under_a_lease_is_down_at_once_then_recovers(
    make_pool: PoolFactory, events: Events
) -> None:
    fake = FakeServer(slots=1)
    await fake.start()
    port = fake.port
    pool = make_pool(ext(fake.url, "flaky"))
    async with pool.lease("flaky") as lease:
        await lease.chat(MSG, max_tokens=1)
    await fake.stop()
    lease = await pool.acquire("flaky")
    with pytest.raises(SlotLost, match="connection refused"):
        await lease.chat(MSG, max_tokens=1)
    lease.release()
    await until(lambda: "slot.unhealthy" in events.kinds())
    with pytest.raises(NoHealthyMember):
        await pool.acquire("flaky")
    back = FakeServer(slots=1)
    await back.start(port)
    try:
        await until(lambda: "slot.recovered" in events.kinds())
        async with pool.lease("flaky") as lease:
            await lease.chat(MSG, max_tokens=1)
    finally:
        await back.stop()
    assert "slot.restarting" not in events.kinds()


async def test_a_5xx_health_check_marks_it_unhealthy_and_a_200_brings_it_back(
    fake: FakeServer, make_pool: PoolFactory, events: Events
) -> None:
    pool = make_pool(ext(fake.url, "ext"))
    await pool.wait_ready("ext")
    fake.health_status = 502  # e.g. a proxy whose upstream went away
    await until(lambda: "slot.unhealthy" in events.kinds())
    unhealthy = next(e for e in events if e.kind == "slot.unhealthy")
    assert "answered 502" in unhealthy.detail["reason"]
    with pytest.raises(NoHealthyMember):
        await pool.acquire("ext")
    fake.health_status = None
    await until(lambda: "slot.recovered" in events.kinds())
    async with pool.lease("ext") as lease:
        await lease.chat(MSG, max_tokens=1)


async def test_a_5xx_reply_alone_does_not_take_a_healthy_member_down(
    fake: FakeServer, make_pool: PoolFactory, events: Events
) -> None:
    pool = make_pool(ext(fake.url, "ext"))
    fake.fail_next = 1
    async with pool.lease("ext") as lease:
        with pytest.raises(Exception, match="answered 500"):
            await lease.chat(MSG, max_tokens=1)
    await asyncio.sleep(0.3)  # the probe it triggered found /health fine
    assert "slot.unhealthy" not in events.kinds()
    async with pool.lease("ext") as lease:
        await lease.chat(MSG, max_tokens=1)


async def test_waiters_of_a_member_that_goes_down_fail_at_once(
    make_pool: PoolFactory, events: Events
) -> None:
    fake = FakeServer(slots=1)
    await fake.start()
    pool = make_pool(ext(fake.url, "ext"))
    held = await pool.acquire("ext")
    waiter = asyncio.ensure_future(pool.acquire("ext"))
    await asyncio.sleep(0.05)
    assert not waiter.done()
    await fake.stop()
    with pytest.raises(NoHealthyMember):  # the waiter has no deadline: only the health
        await asyncio.wait_for(waiter, 30)  # check can end its wait (30 s: a hang's bound)
    assert held.lost is not None
    held.release()


async def test_a_spawned_server_that_never_gets_ready_cools_down_instead_of_retrying_forever(
    make_pool: PoolFactory, events: Events, tmp_path: Path
) -> None:
    # each start times out after longer than the failure window: three in a row still count
    options = FAST.model_copy(update={"failure_window_s": 0.05})
    never = spawned("slow", "--ready-file", str(tmp_path / "never"), ready_timeout_s=0.3)
    pool = make_pool(never, options=options)
    with pytest.raises(NoHealthyMember, match="cooling down"):  # 30 s: a hang's bound
        await asyncio.wait_for(pool.acquire("slow"), 30)
    assert events.kinds().count("slot.failed") == 3
    assert events.kinds()[-1] == "slot.cooldown"


async def test_a_member_down_before_its_reason_is_recorded_names_the_instances(
    make_pool: PoolFactory,
) -> None:
    """An instance turns unhealthy (its own last_error set) and then awaits its ledger entry
    before the member records the reason: a lease in that moment named "unreachable: None"."""
    _, url = closed_url()
    pool = make_pool(ext(url, "gone"))
    with pytest.raises(NoHealthyMember):
        await pool.acquire("gone")
    member = pool._members["gone"]
    member.last_error = None  # the moment between the instance's state and went_down()
    assert member.why() == f"is unreachable: {member.instances[0].last_error}"
    assert "None" not in member.why()
    member.instances[0].last_error = None
    assert member.why() == "is unreachable: its health check failed"
