"""Process supervision with real child processes (the fake server run as a subprocess)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from daemon.slots import Pool, PoolBusy, SlotLost
from daemon.slots.digest import DigestCache, DigestMismatch
from daemon.slots.process import ServerProcess, render_argv, rotate_logs
from roster import Member
from tests.polling import until
from tests.slots.conftest import FAST, REPO, Events, PoolFactory, roster_of, spawned

MSG = [{"role": "user", "content": "hi"}]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0): look at its state
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


async def fault(url: str, **body: Any) -> None:
    async with aiohttp.ClientSession() as s, s.post(url + "/_fault", json=body) as r:
        assert r.status == 200


def pid_of(pool: Pool, member: str = "fake") -> int:
    status = pool.status().member(member)
    assert status is not None
    pid = status.instances[0].pid
    assert pid is not None
    return pid


async def test_spawn_uses_the_servers_slot_count_and_logs(
    make_pool: PoolFactory, state_dir: Path, events: Events, caplog: pytest.LogCaptureFixture
) -> None:
    member = Member(
        name="fake",
        command=["{python}", "-m", "tests.slots.fake_server", "--port", "{port}", "--slots", "3"],
        slots=2,
        ctx=512,
    )
    pool = make_pool(member)
    await pool.start()
    async with pool.lease("fake") as lease:
        result = await lease.chat(MSG, max_tokens=2)
        assert result.text == "t0 t1 "
    status = pool.status().member("fake")
    assert status is not None
    assert status.instances[0].slots_total == 3
    assert "server reports 3" in caplog.text
    log = (state_dir / "logs" / "fake-0.log").read_text()
    assert "fake server listening" in log
    starting = next(e for e in events if e.kind == "slot.starting")
    assert starting.detail["argv"][0] == sys.executable
    pid = pid_of(pool)
    await pool.stop()
    assert not alive(pid)


async def test_slow_load_with_503_then_ready(make_pool: PoolFactory, events: Events) -> None:
    pool = make_pool(spawned("fake", "--load-delay", "0.5"))
    async with pool.lease("fake") as lease:
        await lease.chat(MSG, max_tokens=1)
    ready = next(e for e in events if e.kind == "slot.ready")
    assert ready.detail["ready_ms"] >= 450
    assert ready.detail["slots"] == 2
    assert ready.detail["n_ctx"] == 512


async def test_crash_mid_stream_loses_the_lease_and_restarts(
    make_pool: PoolFactory, events: Events
) -> None:
    pool = make_pool(spawned("fake"))
    async with pool.lease("fake") as lease:
        first_pid = pid_of(pool)
        assert lease.server_url is not None
        await fault(lease.server_url, mode="crash", after=2)
        with pytest.raises(SlotLost):
            await lease.chat(MSG, max_tokens=20, on_delta=lambda _: None)
    async with pool.lease("fake", deadline=time.monotonic() + 10) as lease:
        assert (await lease.chat(MSG, max_tokens=1)).text == "t0 "
    assert pid_of(pool) != first_pid
    kinds = events.kinds()
    assert "slot.exited" in kinds
    assert "slot.restarting" in kinds
    assert kinds.count("slot.ready") == 2
    assert pool.status().member("fake").restarts == 1  # type: ignore[union-attr]


async def test_server_killed_under_a_lease_is_slot_lost(
    make_pool: PoolFactory, events: Events
) -> None:
    pool = make_pool(spawned("fake", "--token-delay", "0.05"))
    async with pool.lease("fake") as lease:
        pid = pid_of(pool)
        chat = asyncio.ensure_future(lease.chat(MSG, max_tokens=200))
        await asyncio.sleep(0.3)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(SlotLost):
            await asyncio.wait_for(chat, 5)
    await until(lambda: "slot.ready" in events.kinds()[2:])
    lost = [e for e in events if e.kind in ("slot.exited", "slot.lost")]
    assert lost
    assert all(isinstance(v, int | str | None | list) for e in lost for v in e.detail.values())


async def test_hang_is_detected_by_health_checks(make_pool: PoolFactory, events: Events) -> None:
    pool = make_pool(spawned("fake"))
    async with pool.lease("fake") as lease:
        assert lease.server_url is not None
        await fault(lease.server_url, mode="hang")
        chat = asyncio.ensure_future(lease.chat(MSG, max_tokens=5))
        with pytest.raises(SlotLost, match="hung"):
            await asyncio.wait_for(chat, 5)
    await until(lambda: "slot.exited" in events.kinds())
    exited = next(e for e in events if e.kind == "slot.exited")
    assert "hung" in exited.detail["reason"]
    async with pool.lease("fake", deadline=time.monotonic() + 10) as lease:
        await lease.chat(MSG, max_tokens=1)


async def test_not_ready_in_time_is_killed_and_reported_with_its_log(
    make_pool: PoolFactory, events: Events
) -> None:
    # 2 s, not less: under load the fake's interpreter alone can take half a second to print.
    pool = make_pool(spawned("fake", "--hang", ready_timeout_s=2.0))
    with pytest.raises(PoolBusy, match="cooling down"):
        async with pool.lease("fake"):
            pass
    failed = [e for e in events if e.kind == "slot.failed"]
    assert len(failed) == 3
    assert "not ready within 2 s" in failed[0].detail["reason"]
    assert any("fake server listening" in e.detail["log_tail"] for e in failed)
    assert events.kinds().count("slot.restarting") == 2
    assert events.kinds()[-1] == "slot.cooldown"
    await asyncio.sleep(0.1)
    assert pool.status().member("fake").instances[0].pid is None  # type: ignore[union-attr]


async def test_repeated_failures_cool_down_then_recover(
    make_pool: PoolFactory, events: Events, state_dir: Path
) -> None:
    pool = make_pool(spawned("fake", "--die-on-start"))
    with pytest.raises(PoolBusy) as err:
        async with pool.lease("fake"):
            pass
    assert err.value.retry_after >= 0.5
    restarting = [e.detail["delay_ms"] for e in events if e.kind == "slot.restarting"]
    assert restarting == [50, 100]  # exponential backoff
    status = pool.status().member("fake")
    assert status is not None
    assert status.state == "cooldown"
    assert status.cooldown_remaining_ms > 0
    assert "code 5" in (status.last_error or "")
    with pytest.raises(PoolBusy):  # refused at once while cooling down: a deadline that
        await pool.acquire("fake", deadline=time.monotonic())  # passed is never reached
    # after the cooldown a (fixed) member starts again on the next lease
    await pool.reload(roster_of(spawned("fake")))
    await asyncio.sleep(0.7)
    async with pool.lease("fake", deadline=time.monotonic() + 10) as lease:
        await lease.chat(MSG, max_tokens=1)


async def test_missing_model_cools_down_at_once(make_pool: PoolFactory, events: Events) -> None:
    member = spawned("fake", "--model", "{model}", model="/nonexistent/model.gguf")
    pool = make_pool(member)
    with pytest.raises(PoolBusy):
        await pool.acquire("fake")
    assert events.kinds() == ["slot.failed", "slot.cooldown"]
    assert "no model file" in events[0].detail["reason"]


async def test_idle_unload_then_start_on_demand(make_pool: PoolFactory, events: Events) -> None:
    pool = make_pool(spawned("fake", idle_unload_s=0.3))
    async with pool.lease("fake") as lease:
        await lease.chat(MSG, max_tokens=1)
    pid = pid_of(pool)
    await until(lambda: "slot.unloaded" in events.kinds())
    assert not alive(pid)
    assert pool.status().member("fake").state == "stopped"  # type: ignore[union-attr]
    unloaded = next(e for e in events if e.kind == "slot.unloaded")
    assert unloaded.detail["idle_ms"] >= 250
    async with pool.lease("fake", deadline=time.monotonic() + 10) as lease:
        await lease.chat(MSG, max_tokens=1)
    assert pid_of(pool) != pid


async def test_busy_member_is_not_unloaded(make_pool: PoolFactory, events: Events) -> None:
    pool = make_pool(spawned("fake", idle_unload_s=0.2))
    async with pool.lease("fake"):
        await asyncio.sleep(0.5)
    assert "slot.unloaded" not in events.kinds()


async def test_server_dies_with_a_sigkilled_daemon(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import asyncio, sys
        sys.path.insert(0, {str(REPO)!r})
        from daemon.slots import Pool
        from tests.slots.conftest import FAST, roster_of, spawned

        async def main():
            pool = Pool(roster_of(spawned("fake")), {str(tmp_path / "state")!r}, options=FAST)
            async with pool.lease("fake"):
                print(pool.status().members[0].instances[0].pid, flush=True)
                await asyncio.sleep(60)

        asyncio.run(main())
        """
    )
    daemon = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, stdout=subprocess.PIPE
    )
    try:
        assert daemon.stdout is not None
        line = await asyncio.wait_for(daemon.stdout.readline(), 20)
        server_pid = int(line)
        assert alive(server_pid)
        daemon.kill()
        await daemon.wait()
        await until(lambda: not alive(server_pid))
    finally:
        if daemon.returncode is None:
            daemon.kill()
            await daemon.wait()


def test_argv_rendering_and_log_rotation(tmp_path: Path) -> None:
    argv = render_argv(
        ["{python}", "-m", "x", "--port={port}", "-c", "{ctx}", "{literal}"],
        {"port": 8080, "ctx": 4096},
    )
    assert argv == [sys.executable, "-m", "x", "--port=8080", "-c", "4096", "{literal}"]
    log = tmp_path / "m.log"
    for i in range(5):
        rotate_logs(log, keep=3)
        log.write_text(str(i))
    assert log.read_text() == "4"
    assert [(tmp_path / f"m.log.{i}").read_text() for i in (1, 2, 3)] == ["3", "2", "1"]
    assert not (tmp_path / "m.log.4").exists()


def test_model_digest_is_checked_and_cached(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"weights")
    good = "2bcd3ce75ba42ac7f0f0c7b8e3f86ef4cc85b1c3e2a1dd0a5f0e73c6b4eb5e2c"
    cache = DigestCache(tmp_path)
    actual = cache.sha256(model)
    cache.check(model, actual)
    with pytest.raises(DigestMismatch):
        cache.check(model, good)
    # a cached digest is trusted while path, size and mtime stay the same
    assert cache.path.exists()
    assert actual in cache.path.read_text()
    # a damaged cache (nested past json's limit too) is no cache: the file is hashed again
    cache.path.write_text('{"a": ' + "[" * 30_000 + "]" * 30_000 + "}")
    assert cache.sha256(model) == actual


async def test_a_running_servers_log_is_copy_truncated_past_its_cap(tmp_path: Path) -> None:
    writer = (
        "import time\nfor i in range(10**5):\n    print(f'line {i}', flush=True)\n"
        "    time.sleep(0.001)"
    )
    log = tmp_path / "logs" / "w.log"
    process = ServerProcess([sys.executable, "-c", writer], log)
    await process.spawn()
    try:
        await until(lambda: log.exists() and log.stat().st_size > 2000)
        assert not process.rotate_if_over(10**9)  # under the cap: left alone
        assert process.rotate_if_over(1000, keep=2)
        first = (tmp_path / "logs" / "w.log.1").read_bytes()
        assert first.startswith(b"line 0\n")
        assert len(first) > 2000
        for _ in range(2):  # one more than `keep`: the oldest copy is dropped
            await until(lambda: log.stat().st_size > 2000)
            assert process.rotate_if_over(1000, keep=2)
        await until(lambda: log.stat().st_size > 200)
        current = log.read_bytes()
        # the child appends (O_APPEND): no hole of NULs where its old offset was
        assert b"\0" not in current
        assert current.startswith(b"line ")
        assert (tmp_path / "logs" / "w.log.2").exists()
        assert not (tmp_path / "logs" / "w.log.3").exists()  # keep=2
        assert not (tmp_path / "logs" / "w.log.rotating").exists()
        assert process.returncode is None  # the server never noticed
    finally:
        await process.terminate(2)


async def test_the_pool_rotates_a_running_servers_log_on_the_health_tick(
    make_pool: PoolFactory, state_dir: Path
) -> None:
    pool = make_pool(spawned("fake"), options=FAST.model_copy(update={"log_max_bytes": 10}))
    async with pool.lease("fake") as lease:
        await lease.chat(MSG, max_tokens=1)
    logs = state_dir / "logs"
    await until(lambda: (logs / "fake-0.log.1").exists())
    assert b"listening" in (logs / "fake-0.log.1").read_bytes()
    assert b"listening" not in (logs / "fake-0.log").read_bytes()
    assert pool.status().member("fake").state == "ready"  # type: ignore[union-attr]
