"""Who may ask what: the guard every request passes before its handler.

Host and Origin are checked against DNS rebinding; the unix socket's peer is the owner (another
user is refused by its peer credentials); over TCP a bearer token (the default one only from
this machine, or a named client's) or a console session resolves the client, whose scope each
route then checks. The one middleware runs the guard, then turns what a handler raised into the
error body (OpenAI's shape on the gateway's paths).
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import re
import socket
import struct
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from pydantic_core import to_jsonable_python

from daemon.clients import DEFAULT, OWNER, Client
from daemon.errors import Busy, TallyError
from daemon.tls import is_loopback
from surfaces import console
from surfaces.answers import error_response, http_code
from surfaces.app import CLIENT, DAEMON, OPTIONS, HttpOptions
from surfaces.auth import bearer_ok
from surfaces.connections import GATE, STREAM_KEY
from surfaces.gateway import PATHS as GATEWAY_PATHS
from surfaces.gateway import reshaped as gateway_shaped

log = logging.getLogger("tally.http")

SOCKET_HOST = "tally"  # the Host clients send over the unix socket (any value is fine there)
LOOPBACK = ("localhost", "127.0.0.1", "[::1]")
_ORIGIN = re.compile(r"^https?://(localhost|127\.0\.0\.1|\[::1\])(:\d+)?$")


@dataclass(frozen=True)
class Peer:
    """What one connection is allowed, computed once per connection (keep-alive reuses it)."""

    unix: bool
    hosts: frozenset[str]  # acceptable Host header values (lowercase)
    foreign_uid: bool
    origins: frozenset[str] = frozenset()  # acceptable Origin hosts beside loopback's
    remote_loopback: bool = True  # the TCP peer's address is on this machine


_PEERS: weakref.WeakKeyDictionary[Any, Peer] = weakref.WeakKeyDictionary()


def _peer(request: web.Request, options: HttpOptions) -> Peer:
    transport = request.transport
    cached = _PEERS.get(transport) if transport is not None else None
    if cached is not None:
        return cached
    sock = transport.get_extra_info("socket") if transport else None
    unix = sock is not None and sock.family == socket.AF_UNIX
    if unix:
        hosts = frozenset((SOCKET_HOST, *LOOPBACK))
        uid = _peer_uid(sock) if options.check_peer_uid and sock is not None else None
        peer = Peer(True, hosts, uid is not None and uid != os.getuid())
    else:
        sockname = transport.get_extra_info("sockname") if transport else None
        port = sockname[1] if isinstance(sockname, tuple) and len(sockname) > 1 else None
        bound = sockname[0] if isinstance(sockname, tuple) and sockname else None
        peername = transport.get_extra_info("peername") if transport else None
        remote = peername[0] if isinstance(peername, tuple) and peername else "?"
        peer = tcp_peer(bound, port, options.host_names, is_loopback(str(remote)))
    if transport is not None:
        _PEERS[transport] = peer
    return peer


def tcp_peer(
    bound: str | None, port: int | None, host_names: tuple[str, ...], remote_loopback: bool
) -> Peer:
    """What a TCP connection accepts as Host: loopback's names, the address the listener is
    bound to and the operator's `--host-name`s, each bare or with the listener's port. Any
    other name (a DNS-rebinding attacker's) is refused. Origins: loopback's on any port (as
    before), the others only on this listener's port."""
    extra = [host_form(n) for n in (bound, *host_names) if n and not _unspecified(n)]
    names = (*LOOPBACK, *extra)
    hosts = frozenset((*names, *(f"{n}:{port}" for n in names if port is not None)))
    origins = frozenset(f"{n}:{port}" for n in extra if port is not None)
    return Peer(False, hosts, False, origins, remote_loopback)


def host_form(name: str) -> str:
    """How a Host header writes `name`: an IPv6 address in brackets, lowercase."""
    name = name.strip("[]").lower()
    return f"[{name}]" if ":" in name else name


def _unspecified(name: str) -> bool:
    return name.strip("[]") in ("0.0.0.0", "::")


def origin_ok(origin: str, peer: Peer) -> bool:
    """A browser's Origin is this daemon's: a loopback name (any port), or a name the listener
    answers to on its own port, over http or https."""
    if _ORIGIN.match(origin):
        return True
    scheme, sep, rest = origin.lower().partition("://")
    return bool(sep) and scheme in ("http", "https") and rest in peer.origins


def _peer_uid(sock: socket.socket) -> int | None:
    if not hasattr(socket, "SO_PEERCRED"):
        return None
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return None
    _, uid, _ = struct.unpack("3i", raw)
    return int(uid)


def _refuse(request: web.Request, options: HttpOptions) -> web.Response | None:
    """Host/Origin (DNS rebinding), peer and token checks, body limit: None = let it through."""
    peer = _peer(request, options)
    if request.headers.get("Host", "").lower() not in peer.hosts:
        return error_response(
            421,
            "bad_host",
            "Host header is not this daemon's address (loopback, the bind address, or a "
            "`tally serve --host-name`)",
        )
    origin = request.headers.get("Origin")
    if origin is not None and not origin_ok(origin, peer):
        return error_response(403, "forbidden_origin", "cross-origin requests are not allowed")
    if peer.unix:
        if peer.foreign_uid:
            return error_response(403, "forbidden_peer", "socket peer is another user")
        request[CLIENT] = OWNER
    else:
        client = _bearer_client(request, options)
        if client is DEFAULT and not peer.remote_loopback:
            refused = error_response(
                401,
                "unauthorized",
                "the default token (`tally token`) works only from this machine: give a "
                "client on another machine its own token (`tally client add NAME --scope S`)",
                headers={"WWW-Authenticate": 'Bearer realm="tally"'},
            )
            refused.force_close()
            return refused
        key = f"client:{client.name}" if client is not None else ""
        if client is None and console.HEADER in request.headers:
            known = {r.name for r in request.app[DAEMON].clients.known()}
            found = console.session_client(request, known)
            if found is not None:
                client, key = found
                # Only the console's own script holds the secret; a request that carries it
                # with another Origin is a leak being replayed.
                if origin is not None and not console.same_origin(request):
                    return error_response(
                        403, "forbidden_origin", "a console request needs the console's own Origin"
                    )
        if client is None:
            if request.path == "/healthz" or console.public(request.path):
                return None  # liveness for probes (no details); the console's pages and login
            # The gateway (/v1/chat/completions, /v1/embeddings, /v1/models) needs `submit`.
            scope = (
                "submit"
                if request.path.startswith(("/v1/chat", "/v1/emb", "/v1/models"))
                else "read"
            )
            refused = error_response(
                401,
                "unauthorized",
                "a valid bearer token is required over TCP (`tally client add NAME --scope "
                f"{scope}`, or `tally token` for the default client)",
                headers={"WWW-Authenticate": 'Bearer realm="tally"'},
            )
            refused.force_close()  # nothing more to say to it: its descriptor comes back now
            return refused
        request.app[GATE].authenticated(request.transport)
        request[STREAM_KEY] = key
        request[CLIENT] = client
    length = request.content_length
    if length is not None and length > options.body_limit:
        return error_response(413, "payload_too_large", f"body over {options.body_limit} bytes")
    return None


def _bearer_client(request: web.Request, options: HttpOptions) -> Client | None:
    header = request.headers.get("Authorization")
    if not header or not header.startswith("Bearer "):
        return None
    if options.token and bearer_ok(header, options.token):
        return DEFAULT
    return request.app[DAEMON].clients.lookup(header[len("Bearer ") :].strip())


@web.middleware
async def surface_mw(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """One middleware (each layer costs per request): guard first, then map errors to JSON.
    On the gateway's paths every error is in OpenAI's shape: its handlers answer so
    themselves, and what the guard refuses or escapes them (a 401, a 405) is reshaped here."""
    gateway = request.path in GATEWAY_PATHS
    refused = _refuse(request, request.app[OPTIONS])
    if refused is None:
        try:
            return await handler(request)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            refused = _error(request, exc)
    return gateway_shaped(refused) if gateway and refused.status != 499 else refused


def _error(request: web.Request, exc: Exception) -> web.Response:
    """What a handler's exception answers (an HTTPException below 400 goes on up)."""
    if isinstance(exc, web.HTTPException):
        if exc.status < 400:
            raise exc
        allow = exc.headers.get("Allow")  # a 405 must name the methods that are allowed
        headers = {"Allow": allow} if allow is not None else None
        return error_response(exc.status, http_code(exc.status), exc.reason, headers=headers)
    if isinstance(exc, TallyError):
        retry = None
        if isinstance(exc, Busy):
            retry = {"Retry-After": str(max(1, math.ceil(exc.retry_after)))}
        return error_response(
            exc.status, exc.code, exc.message, to_jsonable_python(exc.details), retry
        )
    transport = request.transport
    if isinstance(exc, ConnectionResetError) and (transport is None or transport.is_closing()):
        # the client went away mid-answer: no error of ours (an upstream's reset is)
        log.debug("client gone during %s %s", request.method, request.path)
        return web.Response(status=499)  # what the access log shows ("client closed")
    log.exception("internal error on %s %s", request.method, request.path)
    return error_response(500, "internal", "internal error (see the daemon's log)")
