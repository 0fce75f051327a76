"""What every handler of the daemon's HTTP application shares: its keys (the daemon, the
listener's options, the open SSE streams, the client the guard resolved) and the options
themselves. The lowest of the surface modules: the guard, the routes, the console and the
gateway all read it, and it reads none of them.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from aiohttp import web

from daemon.clients import Client
from surfaces.connections import ConnectionLimits

if TYPE_CHECKING:
    from daemon.service import Daemon


@dataclass(frozen=True)
class HttpOptions:
    token: str | None = None  # required from TCP peers; None = TCP refuses everyone
    body_limit: int = 1024 * 1024
    keepalive_s: float = 15.0  # SSE keep-alive comments
    check_peer_uid: bool = True
    # A connection idle (or still sending its request's headers) this long is closed: it
    # bounds slow-header clients as well as idle keep-alive connections.
    idle_timeout_s: float = 30.0
    body_timeout_s: float = 30.0  # a request body not received in full by then gets a 408
    limits: ConnectionLimits = field(default_factory=ConnectionLimits)  # TCP conns, SSE
    # Names TCP clients reach the daemon by, beside loopback and the bind address (`--host-name`).
    host_names: tuple[str, ...] = ()


DAEMON: web.AppKey[Daemon] = web.AppKey("daemon")
CLIENT = web.RequestKey("client", Client)  # the resolved caller
OPTIONS = web.AppKey("options", HttpOptions)


class Streams:
    """The stop events of open SSE streams (on_shutdown sets them all)."""

    def __init__(self) -> None:
        self.stops: set[asyncio.Event] = set()


STREAMS = web.AppKey("streams", Streams)


def client_of(request: web.Request) -> Client | None:
    """The client the guard resolved (None: an unauthenticated /healthz over TCP)."""
    return request.get(CLIENT)
