"""In-flight failover: a call whose member dies under it (the connection cut mid-body, or a
502) moves once to another member of the tier and succeeds there, witnessed; with nowhere to
go it fails at once naming every member; a streamed call whose text already reached its
consumer is never sent twice. External members on the in-process fake server."""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncIterator

import pytest

from daemon.slots import Pool, SlotLost
from tests.polling import until
from tests.slots.conftest import MSG, Events, PoolFactory
from tests.slots.conftest import single as ext
from tests.slots.fake_server import FakeServer


@pytest.fixture
async def pair() -> AsyncIterator[tuple[FakeServer, FakeServer]]:
    a, b = FakeServer(slots=1), FakeServer(slots=1)
    await a.start()
    await b.start()
    yield a, b
    await a.stop()
    await b.stop()


def recovered(events: Events, times: int) -> bool:
    return events.kinds("a").count("slot.recovered") == times


async def ready(make_pool: PoolFactory, a: FakeServer, b: FakeServer) -> Pool:
    pool = make_pool(ext(a.url + "/v1", "a"), ext(b.url + "/v1", "b"), tiers={"t": ["a", "b"]})
    await pool.wait_ready("t")
    return pool


@pytest.mark.parametrize("how", ["cut", "502"])
async def test_a_call_whose_member_dies_moves_to_the_other_member(
    make_pool: PoolFactory, events: Events, pair: tuple[FakeServer, FakeServer], how: str
) -> None:
    a, b = pair
    pool = await ready(make_pool, a, b)
    a.dying = how
    async with pool.lease("t") as lease:
        assert lease.member == "a"  # the roster's first member serves first
        result = await lease.chat(MSG, max_tokens=3)
        assert (lease.member, result.member) == ("b", "b")
    assert result.text == "t0 t1 t2 "
    assert len(a.requests) == 1
    assert len(b.requests) == 1
    assert b.requests[0]["model"] == "b"  # built anew for the member that took it
    moved = [e for e in events if e.kind == "slot.failover" and e.detail.get("in_flight")]
    assert len(moved) == 1
    assert moved[0].member == "a"
    assert (moved[0].detail["from_member"], moved[0].detail["to_member"]) == ("a", "b")
    assert moved[0].detail["tier"] == "t"
    reason = moved[0].detail["reason"]
    assert ("502" in reason) if how == "502" else ("connection failed" in reason)
    await until(lambda: not pool.status().member("a").healthy)  # type: ignore[union-attr]
    assert pool.status().member("a").state == "unhealthy"  # type: ignore[union-attr]
    assert "slot.restarting" not in events.kinds("a")  # an external member is never restarted
    tier = pool.status().tiers[0]
    assert (tier.in_flight_failovers, tier.healthy) == (1, ["b"])


async def test_with_no_member_left_the_call_fails_at_once_naming_them(
    make_pool: PoolFactory, events: Events, pair: tuple[FakeServer, FakeServer]
) -> None:
    a, b = pair
    pool = await ready(make_pool, a, b)
    a.dying, b.dying = "cut", "502"
    started = time.monotonic()
    with pytest.raises(SlotLost) as err:
        async with pool.lease("t") as lease:
            await lease.chat(MSG, max_tokens=3)
    # No member left: the call fails rather than waiting for one to come back (a bound for a
    # hang, generous for a loaded machine; the members' probes back off for far longer).
    assert time.monotonic() - started < 30
    message = err.value.message
    assert message.startswith("no member of 't' could finish the call: a failed in flight: ")
    assert "; b failed in flight: " in message
    assert "502" in err.value.details["members"]["b"]
    assert "connection failed" in err.value.details["members"]["a"]
    await until(lambda: not any(m.healthy for m in pool.status().members))
    b.dead = False  # b answers again; a stays down
    await until(lambda: pool.status().member("b").healthy)  # type: ignore[union-attr]
    b.dying = "502"
    with pytest.raises(SlotLost) as again:  # a member already down is named with why
        async with pool.lease("t") as lease:
            await lease.chat(MSG, max_tokens=3)
    assert again.value.details["members"]["a"].startswith("is unreachable: ")
    assert again.value.details["members"]["b"].startswith("failed in flight: ")


async def test_a_streamed_call_is_not_moved_once_text_reached_its_consumer(
    make_pool: PoolFactory, events: Events, pair: tuple[FakeServer, FakeServer]
) -> None:
    a, b = pair
    pool = await ready(make_pool, a, b)
    a.crash_after = 2  # two tokens streamed, then the connection drops
    got: list[str] = []
    with pytest.raises(SlotLost):
        async with pool.lease("t") as lease:
            await lease.chat(MSG, max_tokens=5, on_delta=got.append)
    assert got == ["t0 ", "t1 "]
    assert b.requests == []
    assert not [e for e in events if e.kind == "slot.failover"]
    assert pool.status().tiers[0].in_flight_failovers == 0


async def test_a_streamed_call_that_failed_before_any_text_is_moved(
    make_pool: PoolFactory, pair: tuple[FakeServer, FakeServer]
) -> None:
    a, b = pair
    pool = await ready(make_pool, a, b)
    a.dying = "cut"
    got: list[str] = []
    async with pool.lease("t") as lease:
        result = await lease.chat(MSG, max_tokens=2, on_delta=got.append)
    assert (result.member, got) == ("b", ["t0 ", "t1 "])


async def test_a_client_error_is_not_moved(
    make_pool: PoolFactory, pair: tuple[FakeServer, FakeServer]
) -> None:
    a, b = pair
    pool = await ready(make_pool, a, b)
    a.fail_next, a.fail_status = 1, 400
    async with pool.lease("t") as lease:
        with pytest.raises(Exception, match="400"):
            await lease.chat(MSG, max_tokens=2)
    assert b.requests == []
    assert pool.status().member("a").healthy  # type: ignore[union-attr]


async def test_a_lease_on_a_member_is_not_moved(
    make_pool: PoolFactory, events: Events, pair: tuple[FakeServer, FakeServer]
) -> None:
    a, b = pair
    pool = await ready(make_pool, a, b)
    a.dying = "502"
    async with pool.lease("a") as lease:
        with pytest.raises(Exception, match="502"):
            await lease.chat(MSG, max_tokens=2)
    assert b.requests == []
    assert not [e for e in events if e.kind == "slot.failover" and e.detail.get("in_flight")]


async def test_a_member_that_fails_calls_but_answers_health_is_held_down(
    make_pool: PoolFactory, events: Events, pair: tuple[FakeServer, FakeServer]
) -> None:
    """/health says 200 while calls get 502: the member is held down before its first probe,
    twice as long when it fails again soon after it came back, so it does not flap."""
    a, b = pair
    pool = await ready(make_pool, a, b)
    opts = pool.options
    for failures in (1, 2):
        a.fail_next, a.fail_status = 1, 502
        async with pool.lease("t") as lease:
            assert lease.member == "a"
            result = await lease.chat(MSG, max_tokens=3)
            assert result.member == "b"
        await until(functools.partial(recovered, events, failures))
    down = [e for e in events if e.member == "a" and e.kind == "slot.unhealthy"]
    holds = [e.detail["next_probe_ms"] for e in down]
    assert holds == [int(opts.probe_base_s * 1000), int(opts.probe_base_s * 2000)]
    # Each return came after its hold (a sleep never ends early), not at the first probe.
    back = [e.detail["down_ms"] for e in events if e.member == "a" and e.kind == "slot.recovered"]
    assert all(ms >= hold for ms, hold in zip(back, holds, strict=True))
