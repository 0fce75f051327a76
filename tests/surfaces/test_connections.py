"""Connection limits of `tally serve --tcp` as a real process, with its descriptor limit pinned
low (soft = hard = 1024, as the usual default soft limit): 1,100 idle TCP connections with no
token take no descriptors the owner's unix socket needs, and are closed when they do not
authenticate in time; the soft limit is raised to the hard one at start; a 401 closes its
connection; SSE streams are capped per client; every limit is in /metrics."""

from __future__ import annotations

import asyncio
import os
import resource
import select
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import pytest

from daemon.slots.process import free_port
from tests.slots.fake_server import FakeServer
from tests.surfaces.conftest import roster_toml

ROOT = Path(__file__).resolve().parents[2]
FLOOD = 1100


def _nofile(soft: int, hard: int) -> Callable[[], None]:
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    return limit


class Served:
    def __init__(self, tmp_path: Path, model: FakeServer) -> None:
        self.state = tmp_path / "state"
        self.socket = tmp_path / "run" / "tally.sock"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        roster = tmp_path / "roster.toml"
        roster.write_text(roster_toml(model.url))
        base = {k: v for k, v in os.environ.items() if not k.startswith("TALLY_")}
        self.env = base | {"TALLY_STATE_DIR": str(self.state), "TALLY_ROSTER": str(roster)}
        self.log = tmp_path / "serve.log"
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self, nofile: tuple[int, int], **env: str) -> None:
        argv = ["serve", "--tcp", f"127.0.0.1:{self.port}", "--socket", str(self.socket)]
        with self.log.open("a") as log:
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "surfaces", *argv, env=self.env | env, cwd=ROOT,
                stderr=log, preexec_fn=_nofile(*nofile),
            )  # fmt: skip
        for _ in range(300):
            if self.socket.exists():
                try:
                    await self.owner("health")
                    return
                except aiohttp.ClientError:
                    pass
            assert self.proc.returncode is None, self.log.read_text()
            await asyncio.sleep(0.05)
        pytest.fail("the daemon did not listen within 15 s")

    async def owner(self, tool: str) -> dict[str, object]:
        connector = aiohttp.UnixConnector(path=str(self.socket))
        async with (
            aiohttp.ClientSession(connector=connector) as http,
            http.post(f"http://tally/v1/tools/{tool}", json={}) as resp,
        ):
            assert resp.status == 200, await resp.text()
            body: dict[str, object] = await resp.json()
            return body

    async def metrics(self) -> str:
        connector = aiohttp.UnixConnector(path=str(self.socket))
        async with (
            aiohttp.ClientSession(connector=connector) as http,
            http.get("http://tally/metrics") as resp,
        ):
            return await resp.text()

    def fds(self) -> int:
        assert self.proc is not None
        return len(os.listdir(f"/proc/{self.proc.pid}/fd"))

    def token(self) -> str:
        return (self.state / "http.token").read_text().strip()


@pytest.fixture
async def served(tmp_path: Path, model: FakeServer) -> AsyncIterator[Served]:
    s = Served(tmp_path, model)
    try:
        yield s
    finally:
        if s.proc is not None and s.proc.returncode is None:
            s.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(s.proc.wait(), 30)
            except TimeoutError:
                s.proc.kill()
                await s.proc.wait()


def _flood(port: int) -> list[socket.socket]:
    """FLOOD idle connections that never send a byte: 200 from 127.0.0.1 (over the per-peer
    cap), the rest spread over other loopback addresses (over the total cap)."""
    conns = []
    for i in range(FLOOD):
        source = "127.0.0.1" if i < 200 else f"127.0.{1 + i // 50}.{1 + i % 50}"
        conns.append(socket.create_connection(("127.0.0.1", port), 5, (source, 0)))
    return conns


def _answered(conns: list[socket.socket]) -> list[socket.socket]:
    """The connections the daemon has answered (with its 503) or closed."""
    poll = select.poll()
    by_fd = {c.fileno(): c for c in conns}
    for fd in by_fd:
        poll.register(fd, select.POLLIN)
    return [by_fd[fd] for fd, _ in poll.poll(0)]


async def test_idle_unauthenticated_connections_leave_the_owner_its_descriptors(
    served: Served,
) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < FLOOD + 200:
        pytest.skip(f"this test needs {FLOOD + 200} descriptors (hard limit {hard})")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, FLOOD + 200), hard))
    try:
        await served.start((1024, 1024), TALLY_AUTH_TIMEOUT_S="5")
        base = served.fds()
        flooded = time.monotonic()
        conns = await asyncio.to_thread(_flood, served.port)
        print(f"flood took {time.monotonic() - flooded:.2f} s")
        try:
            await asyncio.sleep(0.5)  # the daemon accepts (and refuses) what it can
            # the owner, over the unix socket, is answered (a daemon out of descriptors
            # would not answer at all: 30 s bounds that hang)
            await asyncio.wait_for(served.owner("health"), 30)
            await asyncio.wait_for(served.owner("runs_list"), 30)
            assert served.fds() <= base + 768 + 8 < 1024  # the reserve stayed free
            refused = _answered(conns)
            held = [c for c in conns if c not in set(refused)]
            assert len(held) <= 1024 - 256  # the total cap, below the descriptor limit
            local = [c for c in held if c.getsockname()[0] == "127.0.0.1"]
            assert len(local) <= 64  # the per-peer cap on unauthenticated connections
            answers = [c.recv(200) for c in refused]
            assert sum(a.startswith(b"HTTP/1.1 503 ") for a in answers) == FLOOD - 768
            text = await served.metrics()
            assert 'tally_limit{limit="nofile"} 1024' in text
            assert 'tally_limit{limit="tcp_connections"} 768' in text
            assert 'tally_tcp_refused_total{limit="total"} 0' not in text
            assert 'tally_tcp_refused_total{limit="pending_per_peer"} 0' not in text
            # while the flood holds the total cap, from 18 addresses: a client with a token
            # gets in (the oldest unauthenticated connection makes room), five times over
            headers = {"Authorization": f"Bearer {served.token()}"}
            for _ in range(5):
                started = time.monotonic()
                async with (
                    aiohttp.ClientSession() as http,
                    http.post(f"{served.url}/v1/tools/health", json={}, headers=headers) as r,
                ):
                    assert r.status == 200, await r.text()
                # let in by an eviction, not by waiting out the 5 s auth timeout of the
                # connection it replaces
                assert time.monotonic() - started < 5
            # unauthenticated connections are closed after TALLY_AUTH_TIMEOUT_S
            await asyncio.sleep(5.5)
            assert len(_answered(held)) == len(held)
            assert served.fds() <= base + 8
        finally:
            for c in conns:
                c.close()
        # and a client with a token gets in again
        headers = {"Authorization": f"Bearer {served.token()}"}
        async with (
            aiohttp.ClientSession() as http,
            http.post(f"{served.url}/v1/tools/health", json={}, headers=headers) as resp,
        ):
            assert resp.status == 200
        assert "tally_tcp_auth_timeouts_total 0" not in await served.metrics()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


async def test_the_soft_descriptor_limit_is_raised_to_the_hard_one(served: Served) -> None:
    await served.start((512, 2048))
    text = await served.metrics()
    assert 'tally_limit{limit="nofile"} 2048' in text
    assert "descriptor limit raised from 512 to 2048" in served.log.read_text()
    async with aiohttp.ClientSession() as http, http.get(f"{served.url}/v1/tools") as resp:
        assert resp.status == 401
        assert resp.headers["Connection"] == "close"  # no keep-alive without a token


async def test_event_streams_are_capped_per_client(served: Served) -> None:
    await served.start((1024, 1024), TALLY_SSE_PER_CLIENT="2")
    headers = {"Authorization": f"Bearer {served.token()}"}
    async with aiohttp.ClientSession(headers=headers) as http:
        first = await http.get(f"{served.url}/v1/events")
        second = await http.get(f"{served.url}/v1/events")
        assert (first.status, second.status) == (200, 200)
        async with http.get(f"{served.url}/v1/events") as third:
            assert third.status == 429
            assert (await third.json())["error"]["code"] == "too_many_streams"
            assert third.headers["Retry-After"]
        first.close()
        for _ in range(50):  # the daemon sees the stream go when it next writes or reads
            async with http.get(f"{served.url}/v1/events") as again:
                if again.status == 200:
                    break
            await asyncio.sleep(0.1)
        else:
            pytest.fail("a closed stream was still counted")
        second.close()
    text = await served.metrics()
    assert 'tally_limit{limit="sse_streams_per_client"} 2' in text
    assert 'tally_tcp_refused_total{limit="sse_per_client"} 0' not in text


async def test_a_bad_limit_is_named(served: Served) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "surfaces", "serve", "--socket", str(served.socket),
        env=served.env | {"TALLY_MAX_CONNECTIONS": "lots"}, cwd=ROOT,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 2
    assert b"TALLY_MAX_CONNECTIONS='lots' is not a number" in err
    assert b"Traceback" not in err
