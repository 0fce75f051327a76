"""A client that reads a run's SSE stream slowly costs the daemon bounded memory.

The real daemon and HTTP app on a unix socket (whose buffers are small, so the daemon's writes
block once the reader stops reading); the run streams about 3 MiB of tokens in 64 KiB deltas
(the fake server's "flood"). The reader that does not read is dropped once `limit` events wait
for it: its stream ends with an `overrun` event and no `end`, and resuming with Last-Event-ID
replays the run from the ledger to its end.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from daemon.runs.feed import Listener
from daemon.service import Daemon
from surfaces.client import DaemonClient, Endpoint
from tests.polling import until
from tests.slots.fake_server import FakeServer
from tests.surfaces.conftest import two_tasks


async def _fault(model: FakeServer, **mode: Any) -> None:
    async with aiohttp.ClientSession() as http, http.post(model.url + "/_fault", json=mode) as r:
        assert r.status == 200


async def test_a_reader_that_does_not_read_is_dropped_and_resumes(
    daemon: Daemon,
    model: FakeServer,
    unix_server: Path,
    unix_session: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
) -> None:
    daemon.engine.feed.limit = 8
    await _fault(model, mode="flood", bytes=3 << 20, stream_only=True, count=10)
    view = await daemon.engine.submit("build the api", plan=two_tasks())
    reader, writer = await asyncio.open_unix_connection(str(unix_server))
    head = "Host: localhost\r\nConnection: close\r\n"
    writer.write(f"GET /v1/runs/{view.id}/events HTTP/1.1\r\n{head}\r\n".encode())
    await writer.drain()
    dropped = f"dropped a listener of run {view.id}: 8 events behind"
    peak = 0

    def was_dropped() -> bool:
        # The drop is the event (the feed logs it as it happens); a sampled queue may already
        # be gone by the next poll, so the samples only add evidence that none grew past 8.
        nonlocal peak
        listeners: set[Listener] = daemon.engine.feed._listeners.get(view.id, set())
        peak = max([peak, *(q.qsize() for q in listeners)])
        return any(dropped in r.getMessage() for r in caplog.records)

    # not reading while the run streams, until the daemon drops this reader
    await until(was_dropped, what=f"the log line {dropped!r}")
    assert peak <= 8, peak
    done = await daemon.engine.wait(view.id, timeout=30)
    data = b""
    while chunk := await asyncio.wait_for(reader.read(1 << 20), 10):
        data += chunk
    writer.close()
    text = data.decode()
    assert "event: overrun" in text
    assert "Last-Event-ID" in text
    assert "event: end" not in text
    seqs = [int(line[4:]) for line in text.splitlines() if line.startswith("id: ")]
    # resuming where it was dropped replays the rest of the run from the ledger, to its end
    headers = {"Last-Event-ID": str(seqs[-1])} if seqs else {}
    async with unix_session.get(
        f"http://localhost/v1/runs/{view.id}/events", headers=headers
    ) as resp:
        rest = (await asyncio.wait_for(resp.text(), 30)).split("\n\n")
    lines = [line for frame in rest for line in frame.splitlines()]
    kinds = [line[7:] for line in lines if line.startswith("event: ")]
    assert kinds[-1] == "end", kinds
    datas = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert datas[-1] == {"run_id": view.id}
    assert done.state in ("done", "failed")


async def test_the_cli_client_reading_slowly_resumes_after_an_overrun(
    daemon: Daemon, model: FakeServer, unix_server: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`DaemonClient.events` (the CLI's and the MCP adapter's follower) takes an `overrun` as
    a cue to resume from its last seq: it still sees the run to its end."""
    daemon.engine.feed.limit = 4
    await _fault(model, mode="flood", bytes=3 << 20, stream_only=True, count=10)
    view = await daemon.engine.submit("build the api", plan=two_tasks())
    kinds: list[str] = []
    async with asyncio.timeout(60), DaemonClient(Endpoint(socket_path=unix_server)) as client:
        async for event in client.events(view.id):
            kinds.append(event.event)
            await asyncio.sleep(0.05)  # a slow reader: the daemon's writes block meanwhile
    assert "dropped a listener" in caplog.text
    assert "overrun" not in kinds  # the client resumed instead of passing it on
    assert kinds[-1] == "run.state", kinds[-5:]
