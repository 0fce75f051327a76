"""The TCP listener's connection limits and the process's descriptor budget.

Every TCP connection holds a descriptor, and one process has `RLIMIT_NOFILE` of them for
everything: the owner's unix socket, the ledger's files, the sandbox's pipes, the members'
connections. aiohttp has no connection limit of its own, so the TCP site's protocol factory is
wrapped here (`Gate.factory`) and every accepted connection passes the gate first:

- at most `max_connections` TCP connections at once, and never more than the descriptor limit
  less `fd_reserve`: the rest of the daemon always has that many descriptors; at that cap a
  new connection closes the oldest one that has not authenticated, if any, so connections
  held from many loopback addresses cannot keep a client with a token out;
- at most `max_pending_per_peer` connections per peer address that have not yet made an
  authenticated request;
- a connection that has made no authenticated request `auth_timeout_s` after it was accepted is
  closed (a slow-header or idle unauthenticated client holds a descriptor that long at most),
  and the guard closes a connection after a 401;
- at most `sse_per_client` open SSE streams per TCP client (one console session counts as one
  client); the unix socket's owner is not counted.

A connection over a limit is accepted and answered `503` with `Connection: close` at once, so
its descriptor is back before the next accept, and the listen queue keeps moving. The unix
socket has no gate: its peer is the daemon's own user.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import resource
import ssl
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from aiohttp import web

log = logging.getLogger("tally.connections")


@dataclass(frozen=True)
class ConnectionLimits:
    """Defaults, overridden by `tally serve`'s environment (`TALLY_<NAME upper>`)."""

    max_connections: int = 1024
    max_pending_per_peer: int = 64
    auth_timeout_s: float = 5.0
    fd_reserve: int = 256
    sse_per_client: int = 32

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> ConnectionLimits:
        """`TALLY_MAX_CONNECTIONS`, `TALLY_MAX_PENDING_PER_PEER`, `TALLY_AUTH_TIMEOUT_S`,
        `TALLY_FD_RESERVE`, `TALLY_SSE_PER_CLIENT`; a bad value names its variable."""
        values: dict[str, Any] = {}
        for f in fields(cls):
            name = f"TALLY_{f.name.upper()}"
            raw = env.get(name)
            if raw is None or raw == "":
                continue
            kind = float if f.name.endswith("_s") else int
            try:
                value = kind(raw)
            except ValueError:
                raise ValueError(f"{name}={raw!r} is not a number") from None
            if not value > 0:
                raise ValueError(f"{name}={raw!r} must be above 0")
            values[f.name] = value
        return cls(**values)


def raise_nofile() -> tuple[int, int]:
    """Raise the soft descriptor limit to the hard one (the default soft limit, 1024, is a
    compatibility setting for `select()`; the daemon uses epoll). The limits after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (OSError, ValueError) as exc:  # e.g. a seccomp filter without setrlimit
            log.warning(
                "descriptor limit stays at %d (raising it to %d failed: %s)", soft, hard, exc
            )
        else:
            log.info("descriptor limit raised from %d to %d", soft, hard)
            soft = hard
    else:
        log.info("descriptor limit %d", soft)
    return soft, hard


def _refusal(message: str) -> bytes:
    body = json.dumps(
        {"error": {"code": "too_many_connections", "message": message, "details": {}}}
    ).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


@dataclass
class _Conn:
    peer: str
    timer: asyncio.TimerHandle | None  # set while the connection has not authenticated
    streams: list[_Stream] = field(default_factory=list)
    """Its open SSE streams (released when it closes: a stream's handler notices a gone reader
    only at its next write)."""


@dataclass(eq=False)  # each stream is itself: two of one client are never "equal"
class _Stream:
    key: str
    counted: bool = True


@dataclass
class Gate:
    """The TCP listener's counts, shared by its protocol wrappers, the guard and `/metrics`."""

    limits: ConnectionLimits
    nofile: int
    """The soft descriptor limit when the gate was made."""
    conns: dict[asyncio.BaseTransport, _Conn] = field(default_factory=dict)
    pending: Counter[str] = field(default_factory=Counter)
    refused: Counter[str] = field(default_factory=Counter)
    """Connections and streams turned away, by reason."""
    timed_out: int = 0
    streams: Counter[str] = field(default_factory=Counter)

    @classmethod
    def make(cls, limits: ConnectionLimits) -> Gate:
        return cls(limits, resource.getrlimit(resource.RLIMIT_NOFILE)[0])

    @property
    def max_connections(self) -> int:
        """The configured cap, lowered so that `fd_reserve` descriptors stay free."""
        room = self.nofile - self.limits.fd_reserve
        return max(1, min(self.limits.max_connections, room))

    def factory(self, inner: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        return lambda: _Gated(self, inner)

    def _admit(self, peer: str) -> str | None:
        if self.pending[peer] >= self.limits.max_pending_per_peer:
            return "pending_per_peer"
        if len(self.conns) >= self.max_connections and not self._evict_oldest_pending():
            return "total"
        return None

    def _evict_oldest_pending(self) -> bool:
        """At the total cap, make room by closing the oldest connection that has not
        authenticated (answered 503): loopback has millions of peer addresses, so holders
        spread over them would otherwise keep every new client out, a token or not; the
        newest connection gets its chance to send its request. False if none is pending."""
        for transport, conn in self.conns.items():
            if conn.timer is None:
                continue
            conn.timer.cancel()
            conn.timer = None
            self._unpend(conn.peer)
            del self.conns[transport]  # its connection_lost finds it gone
            self.refused["total"] += 1
            if isinstance(transport, asyncio.WriteTransport):
                transport.write(_refusal("too many connections (total)"))
            transport.close()
            return True
        return False

    def authenticated(self, transport: asyncio.BaseTransport | None) -> None:
        """The guard resolved a client on this connection: it is no longer pending."""
        conn = self.conns.get(transport) if transport is not None else None
        if conn is not None and conn.timer is not None:
            conn.timer.cancel()
            conn.timer = None
            self._unpend(conn.peer)

    def _unpend(self, peer: str) -> None:
        self.pending[peer] -= 1
        if self.pending[peer] <= 0:
            del self.pending[peer]

    def _expire(self, transport: asyncio.BaseTransport) -> None:
        conn = self.conns.get(transport)
        if conn is not None and conn.timer is not None:
            self.timed_out += 1
            transport.close()

    def open_stream(self, key: str, transport: asyncio.BaseTransport | None) -> _Stream | None:
        """Count one more SSE stream for `key` (None: at its cap, refuse it)."""
        if self.streams[key] >= self.limits.sse_per_client:
            self.refused["sse_per_client"] += 1
            return None
        self.streams[key] += 1
        stream = _Stream(key)
        conn = self.conns.get(transport) if transport is not None else None
        if conn is not None:
            conn.streams.append(stream)
        return stream

    def close_stream(self, stream: _Stream, transport: asyncio.BaseTransport | None = None) -> None:
        """Idempotent: its handler's end and its connection's end both close it."""
        conn = self.conns.get(transport) if transport is not None else None
        if conn is not None and stream in conn.streams:
            conn.streams.remove(stream)
        if stream.counted:
            stream.counted = False
            self.streams[stream.key] -= 1
            if self.streams[stream.key] <= 0:
                del self.streams[stream.key]


class _Gated(asyncio.Protocol):
    """One TCP connection: admitted (then aiohttp's handler gets every callback) or refused."""

    def __init__(self, gate: Gate, factory: Callable[[], asyncio.Protocol]) -> None:
        self.gate = gate
        self.factory = factory
        self.inner: asyncio.Protocol | None = None
        self.transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        gate = self.gate
        peername = transport.get_extra_info("peername")
        peer = str(peername[0]) if isinstance(peername, tuple) and peername else "?"
        reason = gate._admit(peer)
        if reason is not None:
            gate.refused[reason] += 1
            assert isinstance(transport, asyncio.WriteTransport)
            transport.write(_refusal(f"too many connections ({reason.replace('_', ' ')})"))
            transport.close()
            return
        loop = asyncio.get_running_loop()
        timer = loop.call_later(gate.limits.auth_timeout_s, gate._expire, transport)
        gate.conns[transport] = _Conn(peer, timer)
        gate.pending[peer] += 1
        self.transport = transport
        self.inner = self.factory()
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.inner is not None:
            self.inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received() if self.inner is not None else None

    def pause_writing(self) -> None:
        if self.inner is not None:
            self.inner.pause_writing()

    def resume_writing(self) -> None:
        if self.inner is not None:
            self.inner.resume_writing()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.inner is None:
            return
        conn = self.gate.conns.pop(self.transport, None) if self.transport else None
        if conn is not None:
            if conn.timer is not None:
                conn.timer.cancel()
                self.gate._unpend(conn.peer)
            for stream in conn.streams:
                self.gate.close_stream(stream)
            conn.streams.clear()
        self.inner.connection_lost(exc)


class GatedTCPSite(web.TCPSite):
    """`web.TCPSite` whose connections pass `gate` first (aiohttp offers no hook for it: the
    site's `start` is the one place the protocol factory is chosen)."""

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str,
        port: int,
        gate: Gate,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        super().__init__(runner, host, port, ssl_context=ssl_context)
        self.gate = gate

    async def start(self) -> None:
        self._runner._reg_site(self)  # what BaseSite.start does (TCPSite.start is replaced)
        loop = asyncio.get_running_loop()
        server = self._runner.server
        assert server is not None
        self._server = await loop.create_server(
            self.gate.factory(server),
            self._host,
            self._port,
            ssl=self._ssl_context,
            # a TLS handshake not done by then is closed: it holds a descriptor before the
            # gate can count it (the gate sees a connection once its handshake is done)
            ssl_handshake_timeout=self.gate.limits.auth_timeout_s if self._ssl_context else None,
            backlog=self._backlog,
            reuse_address=self._reuse_address,
            reuse_port=self._reuse_port,
        )
        sockets = self._server.sockets
        self._bound_port = sockets[0].getsockname()[1] if sockets else self._port


GATE = web.AppKey("gate", Gate)
STREAM_KEY = web.RequestKey("stream_key", str)
"""What a TCP caller's SSE streams count under (a client, or one console session)."""

_Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def counted_stream(handler: _Handler) -> _Handler:
    """An SSE route whose streams count against the caller's `sse_per_client` (429 past it)."""

    @functools.wraps(handler)
    async def counted(request: web.Request) -> web.StreamResponse:
        key = request.get(STREAM_KEY)
        if not key:  # the unix socket's owner
            return await handler(request)
        gate = request.app[GATE]
        stream = gate.open_stream(key, request.transport)
        if stream is None:
            limit = gate.limits.sse_per_client
            body = {
                "error": {
                    "code": "too_many_streams",
                    "message": f"this client has {limit} event streams open (the limit); "
                    "close one first",
                    "details": {"limit": limit},
                }
            }
            return web.json_response(body, status=429, headers={"Retry-After": "5"})
        try:
            return await handler(request)
        finally:
            gate.close_stream(stream, request.transport)

    return counted


def fd_count() -> int | None:
    """Descriptors open in this process (None where /proc is not there)."""
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:
        return None
