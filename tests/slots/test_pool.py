"""The pool against in-process fake servers: leases, queueing, affinity, the chat client."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from aiohttp import web

from daemon.slots import (
    ModelError,
    NoSuchTarget,
    PoolBusy,
    PoolTimeout,
    SlotEvent,
    SlotLost,
)
from roster import Member, Sampling
from tests.slots.conftest import FAST, Events, PoolFactory, roster_of
from tests.slots.fake_server import FakeServer

MSG = [{"role": "user", "content": "say hello"}]


def ext(url: str, name: str = "ext", **kw: Any) -> Member:
    return Member(name=name, url=url, **kw)


async def test_lease_and_chat(fake: FakeServer, make_pool: PoolFactory) -> None:
    member = ext(fake.url, slots=2, model_id="tiny", sampling=Sampling(temperature=0.2, seed=7))
    pool = make_pool(member)
    await pool.start()
    async with pool.lease("t") as lease:
        assert (lease.member, lease.instance) == ("ext", 0)
        result = await lease.chat(MSG, max_tokens=3)
    assert result.text == "t0 t1 t2 "
    assert result.finish_reason == "length"
    assert result.usage.completion_tokens == 3
    assert result.usage.prompt_tokens == 2
    assert result.timings["predicted_n"] == 3
    body = fake.requests[-1]
    assert body["id_slot"] == lease.id_slot
    assert body["cache_prompt"] is True
    assert body["model"] == "tiny"
    assert body["temperature"] == 0.2
    assert body["seed"] == 7
    assert result.request == body
    assert pool.status().member("ext").leases == 0  # type: ignore[union-attr]


async def test_streaming_reads_deltas_usage_and_done(
    fake: FakeServer, make_pool: PoolFactory
) -> None:
    pool = make_pool(ext(fake.url, slots=2))
    await pool.start()
    deltas: list[str] = []
    async with pool.lease("ext") as lease:
        result = await lease.chat(MSG, max_tokens=4, on_delta=deltas.append)
    assert deltas == ["t0 ", "t1 ", "t2 ", "t3 "]
    assert result.text == "".join(deltas)
    assert result.usage.completion_tokens == 4
    assert result.finish_reason == "length"
    assert fake.requests[-1]["stream_options"] == {"include_usage": True}


async def test_repeated_prompt_on_the_same_slot_reports_cached_tokens(
    fake: FakeServer, make_pool: PoolFactory
) -> None:
    pool = make_pool(ext(fake.url, slots=2))
    for _ in range(2):
        async with pool.lease("ext", affinity="lane") as lease:
            result = await lease.chat(MSG, max_tokens=1)
    assert result.usage.cached_tokens == 2


async def test_json_schema_reply(fake: FakeServer, make_pool: PoolFactory) -> None:
    pool = make_pool(ext(fake.url))
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    async with pool.lease("ext") as lease:
        result = await lease.chat(MSG, response_format=schema)
    assert result.text == '{"ok": true}'
    assert fake.requests[-1]["response_format"] == schema


async def test_concurrent_leases_get_distinct_slots_and_the_next_waits(
    fake: FakeServer, make_pool: PoolFactory
) -> None:
    pool = make_pool(ext(fake.url, slots=2))
    first = await pool.acquire("ext")
    second = await pool.acquire("ext")
    assert first.id_slot != second.id_slot
    third = asyncio.ensure_future(pool.acquire("ext"))
    await asyncio.sleep(0.05)
    assert not third.done()
    assert pool.status().member("ext").queue == 1  # type: ignore[union-attr]
    first.release()
    lease = await asyncio.wait_for(third, 1)
    assert lease.id_slot == first.id_slot
    second.release()
    lease.release()


async def test_full_queue_answers_busy_at_once(fake: FakeServer, make_pool: PoolFactory) -> None:
    pool = make_pool(ext(fake.url, slots=1), options=FAST.model_copy(update={"max_queue": 2}))
    held = await pool.acquire("ext")
    waiting = [asyncio.ensure_future(pool.acquire("ext")) for _ in range(2)]
    await asyncio.sleep(0.01)
    refused = asyncio.ensure_future(pool.acquire("ext"))
    await asyncio.sleep(0)  # one loop tick: "at once" means it never waits for anything
    assert refused.done()
    with pytest.raises(PoolBusy) as err:
        await refused
    assert err.value.status == 503
    assert pool.status().member("ext").queue == 2  # type: ignore[union-attr]
    held.release()
    for fut in waiting:
        (await fut).release()


async def test_deadline_times_out_and_leaves_the_queue(
    fake: FakeServer, make_pool: PoolFactory
) -> None:
    pool = make_pool(ext(fake.url, slots=1))
    held = await pool.acquire("ext")
    started = time.monotonic()
    with pytest.raises(PoolTimeout) as err:
        await pool.acquire("ext", deadline=time.monotonic() + 0.1)
    assert time.monotonic() - started >= 0.1  # not before its deadline (how late is load)
    assert err.value.status == 504
    with pytest.raises(PoolTimeout):
        await pool.acquire("ext", deadline=time.monotonic() - 1)
    assert pool.status().member("ext").queue == 0  # type: ignore[union-attr]
    held.release()
    async with pool.lease("ext", deadline=time.monotonic() - 1):
        pass  # a free slot is granted even past the deadline: nothing had to wait


async def test_priority_then_fifo(fake: FakeServer, make_pool: PoolFactory) -> None:
    pool = make_pool(ext(fake.url, slots=1))
    held = await pool.acquire("ext")
    order: list[str] = []

    async def wait(name: str, priority: int) -> None:
        async with pool.lease("ext", priority=priority):
            order.append(name)
            await asyncio.sleep(0)

    tasks = []
    for name, priority in [("a5", 5), ("b1", 1), ("c5", 5), ("d1", 1), ("e0", 0)]:
        tasks.append(asyncio.ensure_future(wait(name, priority)))
        await asyncio.sleep(0)
    held.release()
    await asyncio.gather(*tasks)
    assert order == ["e0", "b1", "d1", "a5", "c5"]


async def test_affinity_returns_the_lanes_slot(fake: FakeServer, make_pool: PoolFactory) -> None:
    pool = make_pool(ext(fake.url, slots=3))
    async with pool.lease("ext", affinity="backend") as lease:
        backend_slot = lease.id_slot
    async with pool.lease("ext", affinity="docs") as lease:
        assert lease.id_slot != backend_slot  # an unclaimed slot, not backend's
        docs_slot = lease.id_slot
    for _ in range(3):
        async with pool.lease("ext", affinity="backend") as lease:
            assert lease.id_slot == backend_slot
        async with pool.lease("ext", affinity="docs") as lease:
            assert lease.id_slot == docs_slot


async def test_cancelled_waiter_leaves_no_trace(fake: FakeServer, make_pool: PoolFactory) -> None:
    pool = make_pool(ext(fake.url, slots=1))
    held = await pool.acquire("ext")
    waiter = asyncio.ensure_future(pool.acquire("ext"))
    await asyncio.sleep(0.01)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert pool.status().member("ext").queue == 0  # type: ignore[union-attr]
    held.release()
    async with pool.lease("ext", deadline=time.monotonic() + 0.5):
        pass


async def test_lease_released_on_error(fake: FakeServer, make_pool: PoolFactory) -> None:
    pool = make_pool(ext(fake.url, slots=1))
    with pytest.raises(ZeroDivisionError):
        async with pool.lease("ext"):
            _ = 1 / 0
    async with pool.lease("ext", deadline=time.monotonic() + 0.5) as lease:
        assert lease.id_slot == 0


async def test_cancelling_a_chat_closes_the_connection(
    fake: FakeServer, make_pool: PoolFactory
) -> None:
    fake.token_delay_s = 0.02
    pool = make_pool(ext(fake.url, slots=2))
    for stream in (False, True):
        seen: list[str] = []

        async def run(stream: bool = stream, seen: list[str] = seen) -> None:
            async with pool.lease("ext") as lease:
                await lease.chat(MSG, max_tokens=500, on_delta=seen.append if stream else None)

        task = asyncio.ensure_future(run())
        await asyncio.sleep(0.2)
        assert fake.processing
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        started = time.monotonic()
        while fake.processing and time.monotonic() - started < 1:
            await asyncio.sleep(0.01)
        assert not fake.processing, "the server kept generating after the cancel"
        assert pool.status().member("ext").leases == 0  # type: ignore[union-attr]


async def test_server_error_raises_model_error_and_keeps_the_member(
    fake: FakeServer, make_pool: PoolFactory
) -> None:
    pool = make_pool(ext(fake.url, slots=1))
    fake.fail_next = 1
    async with pool.lease("ext") as lease:
        with pytest.raises(ModelError) as err:
            await lease.chat(MSG)
    assert err.value.status_code == 500
    async with pool.lease("ext") as lease:
        assert (await lease.chat(MSG, max_tokens=1)).text == "t0 "


async def test_dropped_stream_is_slot_lost(fake: FakeServer, make_pool: PoolFactory) -> None:
    pool = make_pool(ext(fake.url, slots=1))
    fake.crash_after = 2
    async with pool.lease("ext") as lease:
        with pytest.raises(SlotLost):
            await lease.chat(MSG, max_tokens=10, on_delta=lambda _: None)


async def test_request_timeout_is_slot_lost(fake: FakeServer, make_pool: PoolFactory) -> None:
    fake.token_delay_s = 0.5
    pool = make_pool(ext(fake.url, slots=1, request_timeout_s=0.2))
    async with pool.lease("ext") as lease:
        with pytest.raises(SlotLost, match=r"hung: no reply within 0\.2 s"):
            await lease.chat(MSG, max_tokens=10)  # 10 tokens would take 5 s


async def test_external_member_waits_through_loading(
    make_pool: PoolFactory, events: Events
) -> None:
    fake = FakeServer(slots=2, load_delay_s=0.3)
    await fake.start()
    try:
        pool = make_pool(ext(fake.url + "/v1", slots=2))
        started = time.monotonic()
        async with pool.lease("ext") as lease:
            assert time.monotonic() - started >= 0.25
            await lease.chat(MSG, max_tokens=1)
        assert events.kinds() == ["slot.starting", "slot.ready"]
    finally:
        await fake.stop()


async def test_external_member_bounds_concurrency(fake: FakeServer, make_pool: PoolFactory) -> None:
    fake.token_delay_s = 0.01
    pool = make_pool(ext(fake.url, slots=2))

    async def one() -> None:
        async with pool.lease("ext") as lease:
            await lease.chat(MSG, max_tokens=5)

    await asyncio.gather(*(one() for _ in range(6)))
    assert fake.max_concurrent == 2


async def test_openai_only_endpoint_tolerates_missing_health_props_and_slots(
    make_pool: PoolFactory,
) -> None:
    seen: list[dict[str, Any]] = []

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"data": []})

    async def chat(request: web.Request) -> web.Response:
        seen.append(await request.json())
        assert request.headers["Authorization"] == "Bearer sekrit"
        return web.json_response(
            {"choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}]}
        )

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    mp = pytest.MonkeyPatch()
    mp.setenv("TALLY_TEST_KEY", "sekrit")
    try:
        pool = make_pool(ext(f"http://127.0.0.1:{port}/v1", slots=3, api_key_env="TALLY_TEST_KEY"))
        async with pool.lease("ext") as lease:
            result = await lease.chat(MSG)
        assert result.text == "hi"
        assert "id_slot" not in seen[0]
        assert pool.status().member("ext").instances[0].slots_total == 3  # type: ignore[union-attr]
    finally:
        mp.undo()
        await runner.cleanup()


async def test_targets(fake: FakeServer, make_pool: PoolFactory) -> None:
    pool = make_pool(
        ext(fake.url, "a", slots=1),
        ext(fake.url, "b", slots=1),
        tiers={"cheap": ["a", "b"]},
    )
    with pytest.raises(NoSuchTarget):
        await pool.acquire("nope")
    first = await pool.acquire("cheap")
    second = await pool.acquire("cheap")
    assert {first.member, second.member} == {"a", "b"}
    first.release()
    second.release()


async def test_status_and_event_safety(fake: FakeServer, make_pool: PoolFactory) -> None:
    pool = make_pool(ext(fake.url, slots=2))
    status = pool.status().member("ext")
    assert status is not None
    assert status.state == "stopped"
    async with pool.lease("ext"):
        status = pool.status().member("ext")
        assert status is not None
        assert status.state == "ready"
        assert status.instances[0].slots_busy == 1
        assert status.instances[0].slots_idle == 1
        assert status.instances[0].n_ctx == fake.n_ctx
    with pytest.raises(ValueError, match="float"):
        SlotEvent(kind="slot.ready", member="m", instance=0, detail={"t": 0.5})


async def test_reload_adds_and_retires_members(fake: FakeServer, make_pool: PoolFactory) -> None:
    pool = make_pool(ext(fake.url, "a"))
    held = await pool.acquire("a")
    await pool.reload(roster_of(ext(fake.url, "b")))
    with pytest.raises(NoSuchTarget):
        await pool.acquire("a")
    async with pool.lease("b"):
        pass
    held.release()
    assert [m.name for m in pool.status().members] == ["b"]
