"""sd_notify, by hand: the protocol (one datagram to $NOTIFY_SOCKET) is systemd's API.

No-op when not started by systemd (or a test) with NOTIFY_SOCKET set.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import AsyncIterator

log = logging.getLogger(__name__)


def sd_notify(state: str) -> bool:
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr[0] == "@":
        addr = "\0" + addr[1:]  # abstract namespace
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(addr)
            s.sendall(state.encode())
    except OSError as exc:
        log.warning("sd_notify(%r) failed: %s", state.split("\n", 1)[0], exc)
        return False
    return True


def watchdog_interval() -> float | None:
    """Half of $WATCHDOG_USEC in seconds, if the watchdog is on for this process."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return max(int(usec) / 2_000_000, 0.01)
    except ValueError:
        return None


async def watchdog(interval: float) -> None:
    """Ping from the event loop itself, so a blocked loop stops the pings and systemd notices."""
    while True:
        sd_notify("WATCHDOG=1")
        await asyncio.sleep(interval)


@contextlib.asynccontextmanager
async def watchdog_task() -> AsyncIterator[None]:
    interval = watchdog_interval()
    task = asyncio.create_task(watchdog(interval)) if interval else None
    try:
        yield
    finally:
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
