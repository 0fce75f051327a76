"""Every state change is an event: stopping the pool, cooldown stops and the end of a cooldown;
and a stream that ends early is a lost slot, not a short success."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from daemon.slots import PoolBusy, SlotLost
from roster import Member
from tests.polling import TIMEOUT_S, until
from tests.slots.conftest import FAST, Events, PoolFactory, roster_of, spawned
from tests.slots.fake_server import FakeServer

MSG = [{"role": "user", "content": "say hello"}]


def ext(url: str, name: str = "ext", **kw: Any) -> Member:
    return Member(name=name, url=url, **kw)


async def wait_for_kind(events: Events, kind: str) -> None:
    await until(lambda: kind in events.kinds(), what=lambda: f"no {kind} in {events.kinds()}")


async def test_pool_stop_reports_each_running_instance_stopped(
    fake: FakeServer, make_pool: PoolFactory, events: Events
) -> None:
    pool = make_pool(ext(fake.url, "a"), ext(fake.url, "idle"))
    async with pool.lease("a") as lease:
        await lease.chat(MSG, max_tokens=1)
    await pool.stop()
    assert events.kinds("a") == ["slot.starting", "slot.ready", "slot.stopped"]
    stopped = events[-1]
    assert stopped.detail["reason"] == "pool_stop"
    assert stopped.detail["previous"] == "ready"
    assert events.kinds("idle") == []  # never started: nothing changed, nothing to report
    await pool.stop()  # a second stop changes nothing and says nothing
    assert events.kinds("a") == ["slot.starting", "slot.ready", "slot.stopped"]


async def test_pool_stop_under_a_lease_reports_lost_then_stopped(
    fake: FakeServer, make_pool: PoolFactory, events: Events
) -> None:
    pool = make_pool(ext(fake.url))
    lease = await pool.acquire("ext")
    await pool.stop()
    assert lease.lost == "pool stopped"
    assert events.kinds()[-2:] == ["slot.lost", "slot.stopped"]
    lease.release()


async def test_retired_member_reports_stopped(
    fake: FakeServer, make_pool: PoolFactory, events: Events
) -> None:
    pool = make_pool(ext(fake.url, "a"))
    held = await pool.acquire("a")
    await pool.reload(roster_of(ext(fake.url, "b")))
    assert "slot.stopped" not in events.kinds("a")  # retired only once idle
    held.release()
    await wait_for_kind(events, "slot.stopped")
    stopped = next(e for e in events if e.kind == "slot.stopped")
    assert (stopped.member, stopped.detail["reason"]) == ("a", "retired")


async def test_cooldown_stops_the_other_instances_and_its_end_is_reported(
    make_pool: PoolFactory, events: Events, tmp_path: Path
) -> None:
    ready = tmp_path / "ready"  # "loading" until the test creates it
    member = spawned("m", "--ready-file", str(ready), slots=1, instances=2, ready_timeout_s=0.5)
    pool = make_pool(member)
    waits = [asyncio.ensure_future(pool.acquire("m")) for _ in range(2)]
    for result in await asyncio.gather(*waits, return_exceptions=True):
        assert isinstance(result, PoolBusy), result
    await wait_for_kind(events, "slot.stopped")
    cooled = next(e for e in events if e.kind == "slot.cooldown")
    stopped = [e for e in events if e.kind == "slot.stopped"]
    assert [(e.instance, e.detail["reason"]) for e in stopped] == [
        (1 - cooled.instance, "cooldown")
    ]
    await wait_for_kind(events, "slot.cooldown_ended")
    ended = next(e for e in events if e.kind == "slot.cooldown_ended")
    assert ended.instance == cooled.instance, (ended, cooled)
    assert "not ready" in ended.detail["last_error"], ended.detail
    status = pool.status().member("m")
    assert status is not None
    assert status.state == "stopped", status
    assert {i.state for i in status.instances} == {"stopped"}, status.instances
    ready.touch()  # fixed: the next lease starts the same member again
    # ready_timeout_s=0.5 only made the loading failures quick. A freshly spawned server must
    # start Python and listen within it, which a loaded machine does not do in 0.5 s (the
    # restart then failed three times and cooled down again): the restart gets a bound that
    # only a hang reaches. Same runtime, so it is still the cooled member that starts.
    runtime = pool._members["m"]
    runtime.spec = runtime.spec.model_copy(update={"ready_timeout_s": TIMEOUT_S})
    async with pool.lease("m", deadline=time.monotonic() + TIMEOUT_S) as lease:
        await lease.chat(MSG, max_tokens=1)


async def test_pool_stop_during_a_cooldown_reports_stopped_not_ended(
    make_pool: PoolFactory, events: Events, tmp_path: Path
) -> None:
    member = spawned("m", "--ready-file", str(tmp_path / "never"), slots=1, ready_timeout_s=0.3)
    pool = make_pool(member)
    with pytest.raises(PoolBusy):
        await pool.acquire("m")
    await pool.stop()
    await asyncio.sleep(FAST.cooldown_s + 0.1)
    assert events.kinds()[-2:] == ["slot.cooldown", "slot.stopped"]
    assert events[-1].detail == {
        "reason": "pool_stop",
        "message": "pool stopped",
        "previous": "cooldown",
        "returncode": None,
    }


async def test_stream_ending_without_done_or_finish_reason_is_slot_lost(
    fake: FakeServer, make_pool: PoolFactory
) -> None:
    pool = make_pool(ext(fake.url, slots=1))
    deltas: list[str] = []
    fake.truncate_after = 2
    async with pool.lease("ext") as lease:
        with pytest.raises(SlotLost, match="without"):
            await lease.chat(MSG, max_tokens=10, on_delta=deltas.append)
    assert deltas == ["t0 ", "t1 "]  # what was streamed, but no ChatResult with partial text
    async with pool.lease("ext") as lease:  # the next request completes normally
        result = await lease.chat(MSG, max_tokens=3, on_delta=lambda _: None)
    assert (result.text, result.finish_reason) == ("t0 t1 t2 ", "length")
