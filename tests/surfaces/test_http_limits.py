"""The HTTP server's limits, with raw sockets against the real app on loopback TCP: a client
that sends its headers byte by byte, never finishes its body or idles is disconnected, and a
malformed request is one WARNING line in the log, not an ERROR with a traceback."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from daemon.service import Daemon
from surfaces.http import HttpOptions, app_runner, create_app
from tests.surfaces.conftest import TOKEN

LIMIT_S = 0.5


@pytest.fixture
async def port(daemon: Daemon) -> AsyncIterator[int]:
    options = HttpOptions(token=TOKEN, idle_timeout_s=LIMIT_S, body_timeout_s=LIMIT_S)
    runner = app_runner(create_app(daemon, options), options)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield runner.addresses[0][1]
    finally:
        await runner.cleanup()


async def closed_within(reader: asyncio.StreamReader, seconds: float) -> bytes:
    """Everything the server sends until it closes the connection (fails if it does not)."""
    data = b""
    async with asyncio.timeout(seconds):
        while chunk := await reader.read(65536):
            data += chunk
    return data


async def test_slow_headers_are_cut_off(port: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    request = f"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nX-Slow: " + "a" * 200
    start = time.monotonic()
    closed = False
    for byte in request.encode():  # one byte every 20 ms: 4 s to finish, never finished
        writer.write(bytes([byte]))
        try:
            await writer.drain()
        except ConnectionError:
            closed = True
            break
        if reader.at_eof() or time.monotonic() - start > 4:
            break
        await asyncio.sleep(0.02)
    if not closed:
        await closed_within(reader, 3)
    assert time.monotonic() - start < LIMIT_S + 3  # long before the headers were complete
    writer.close()


async def test_a_body_that_never_arrives_gets_408_and_the_connection_closes(port: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = (
        f"POST /v1/tools/route HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Authorization: Bearer {TOKEN}\r\nContent-Type: application/json\r\n"
        "Content-Length: 100\r\n\r\n"
    )
    writer.write(head.encode() + b'{"text": "the ')  # 14 of the 100 bytes promised
    await writer.drain()
    start = time.monotonic()
    data = await closed_within(reader, LIMIT_S + 4)  # + the lingering read (2 s)
    assert data.startswith(b"HTTP/1.1 408 "), data[:200]
    body = data.split(b"\r\n\r\n", 1)[1]
    assert json.loads(body)["error"]["code"] == "request_timeout"
    assert time.monotonic() - start >= LIMIT_S * 0.9
    writer.close()


async def test_idle_keep_alive_connections_are_closed(port: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        f"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Authorization: Bearer {TOKEN}\r\n\r\n".encode()
    )
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    assert head.startswith(b"HTTP/1.1 200 ")
    start = time.monotonic()
    await closed_within(reader, LIMIT_S + 3)  # the body, then EOF once idle too long
    assert time.monotonic() - start >= LIMIT_S * 0.5
    writer.close()


@pytest.mark.parametrize(
    "header",
    [
        b"X-Big: " + b"a" * 20_000,  # past aiohttp's 8190-byte field limit
        b"X-Null: \x00",  # an invalid header value
        b"Bad Header Name: x",
    ],
)
async def test_malformed_requests_log_one_warning_line(
    port: int, caplog: pytest.LogCaptureFixture, header: bytes
) -> None:
    caplog.set_level(logging.DEBUG, logger="aiohttp")
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        f"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n".encode() + header + b"\r\n\r\n"
    )
    await writer.drain()
    data = await closed_within(reader, 5)
    writer.close()
    assert data.startswith((b"HTTP/1.0 400 ", b"HTTP/1.1 400 ")), data[:100]
    records = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(records) == 1, [r.getMessage() for r in records]
    [record] = records
    assert record.levelno == logging.WARNING
    assert record.exc_info is None
    assert "\n" not in record.getMessage()
    assert "127.0.0.1" in record.getMessage()
    assert len(record.getMessage()) < 500
