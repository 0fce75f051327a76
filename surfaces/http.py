"""The daemon's HTTP server and its start-up: the aiohttp application with every route, the
server's limits, the listeners (a unix socket, 0600, by default; TCP on loopback, or beyond it
over TLS, opt-in), the signals that stop it, and systemd's notifications (READY once the ledger
is recovered and every listener listens).

The top of the surface modules; nothing imports it back. Below it: `surfaces.access` (the guard
every request passes), `surfaces.routes` (the tools' routes), `surfaces.openapi` (the document
describing them), the console and the gateway, and under all of them `surfaces.app` (the
application's keys and options) and `surfaces.answers` (the error body, SSE frames).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from daemon.errors import TallyError
from daemon.tls import Listener, bind_refusal, fingerprint, server_context
from surfaces import console
from surfaces.access import host_form, surface_mw
from surfaces.app import DAEMON, OPTIONS, STREAMS, HttpOptions, Streams
from surfaces.connections import GATE, Gate, GatedTCPSite, counted_stream, raise_nofile
from surfaces.gateway import add_routes as gateway_routes
from surfaces.notify import sd_notify, watchdog_task
from surfaces.openapi import get_openapi
from surfaces.routes import (
    call_tool,
    call_types,
    close_streams,
    get_metrics,
    get_record_schema,
    healthz,
    list_tools,
    registry,
    run_events,
)

if TYPE_CHECKING:
    from daemon.service import Daemon

# `HttpOptions` is what `serve` and `create_app` take: callers import it from here.
__all__ = [
    "HttpOptions",
    "Listen",
    "app_runner",
    "create_app",
    "log_to_stderr",
    "parse_tcp",
    "serve",
    "warm",
]

log = logging.getLogger("tally.http")

# After this long listening, the daemon loads what a first tool call needs (`warm`): later than
# any readiness probe or spawn-and-call client, sooner than most people's first request.
WARM_AFTER_S = 0.5


def warm(daemon: Daemon) -> None:
    """Load what the first tool call would otherwise pay for (~30 ms): the registry, the
    router's index and the checkpoint key (`Daemon.warm`). `serve` runs it on the loop once
    the daemon has listened for `WARM_AFTER_S`, so neither readiness nor a quick first call
    waits on the other."""
    registry()
    call_types()
    daemon.warm()


class ServerLog(logging.LoggerAdapter[logging.Logger]):
    """aiohttp's server log. A malformed request (oversized or invalid headers, a bad request
    line) is the client's doing: one WARNING line naming the peer and the reason, not an
    ERROR with a traceback per request. Anything else keeps its traceback."""

    def exception(self, msg: object, *args: object, exc_info: Any = True, **kwargs: Any) -> None:
        exc = exc_info if isinstance(exc_info, BaseException) else sys.exc_info()[1]
        if isinstance(exc, HttpProcessingError):
            where = str(msg) % args if args else str(msg)
            why = " ".join(str(exc.message).split())[:300]  # the peer's bytes, on one line
            self.logger.warning("%s: %s %s", where, exc.code, why)
            return
        super().exception(msg, *args, exc_info=exc_info, **kwargs)


def app_runner(app: web.Application, options: HttpOptions) -> web.AppRunner:
    """The runner with the server's limits: idle and slow-header connections are closed after
    `idle_timeout_s`, bad requests are logged as one line."""
    return web.AppRunner(
        app,
        shutdown_timeout=5.0,
        access_log=None,
        keepalive_timeout=options.idle_timeout_s,
        # After an early answer (413, 408) the unread rest of a body is drained this long at
        # most, so the client can read the answer, then the connection is closed.
        lingering_time=2.0,
        logger=ServerLog(logging.getLogger("aiohttp.server")),
    )


def create_app(daemon: Daemon, options: HttpOptions | None = None) -> web.Application:
    options = options or HttpOptions()
    app = web.Application(middlewares=[surface_mw], client_max_size=options.body_limit)
    app[DAEMON] = daemon
    app[OPTIONS] = options
    app[STREAMS] = Streams()
    app[GATE] = Gate.make(options.limits)
    app.on_shutdown.append(close_streams)
    app.router.add_get("/v1/tools", list_tools)
    app.router.add_post("/v1/tools/{name}", call_tool)
    app.router.add_get("/v1/runs/{run_id}/events", counted_stream(run_events))
    app.router.add_get("/metrics", get_metrics)
    app.router.add_get("/openapi.json", get_openapi)
    app.router.add_get("/v1/record/schema", get_record_schema)
    app.router.add_get("/healthz", healthz)
    gateway_routes(app)
    console.register(app)
    return app


def parse_tcp(value: str, *, tls: bool = False, insecure_http: bool = False) -> tuple[str, int]:
    """`ADDR:PORT` (`[v6]:PORT` for IPv6), refused beyond loopback unless it is served with
    `tls` or `insecure_http` is asked for (`daemon.tls.bind_refusal`): a caller that does not
    say gets loopback only, as before."""
    host, sep, port = value.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"--tcp wants ADDR:PORT (e.g. 127.0.0.1:8765), got {value!r}")
    refusal = bind_refusal(host, tls, insecure_http)
    if refusal is not None:
        raise ValueError(refusal)
    return host, int(port)


@dataclass(frozen=True)
class Listen:
    socket_path: Path | None
    tcp: str | None = None
    # TLS for the TCP listener: (certificate chain, key); None = plain HTTP
    tls: tuple[Path, Path] | None = None
    insecure_http: bool = False  # plain HTTP beyond loopback, asked for (`--insecure-http`)


def _prepare_socket_path(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    if path.exists() or path.is_symlink():
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink()  # stale socket from a crashed daemon
        else:
            raise TallyError(f"another daemon is listening on {path}")
        finally:
            probe.close()


async def serve(
    daemon: Daemon,
    listen: Listen,
    options: HttpOptions,
    *,
    announce: Callable[[list[str]], None] | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Start the daemon, listen, notify READY, run until SIGTERM/SIGINT, stop cleanly.

    READY=1 is sent only after `daemon.start()` (ledger recovered) and every site listens.
    """
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    if listen.socket_path is not None:
        # Refuse before opening the ledger, and never touch a socket another daemon owns.
        _prepare_socket_path(listen.socket_path)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    raise_nofile()  # before anything opens: the TCP gate sizes itself from the limit
    daemon.stop_requested = stop  # `tally stop` (the daemon_stop tool) stops as SIGTERM does
    await daemon.start()
    runner = app_runner(create_app(daemon, options), options)
    where: list[str] = []
    daemon.listeners = where  # for `status`, filled as each site listens
    bound_socket = False
    warming: asyncio.TimerHandle | None = None
    try:
        await runner.setup()
        if listen.socket_path is not None:
            _prepare_socket_path(listen.socket_path)
            old = os.umask(0o177)  # the socket is born 0600: no window where others can connect
            try:
                await web.UnixSite(runner, str(listen.socket_path)).start()
                bound_socket = True
            finally:
                os.umask(old)
            os.chmod(listen.socket_path, 0o600)
            where.append(f"unix:{listen.socket_path}")
        if listen.tcp is not None:
            base = await _start_tcp(runner, daemon, listen, options)
            where.append(base)
            console.set_base(runner.app, base)
        if announce is not None:
            announce(where)
        sd_notify(f"READY=1\nSTATUS=listening on {', '.join(where)}")
        warming = loop.call_later(WARM_AFTER_S, warm, daemon)
        async with watchdog_task():
            await stop.wait()
        sd_notify("STOPPING=1")
        _say_stopping(daemon)
    finally:
        if warming is not None:
            warming.cancel()  # a stop within WARM_AFTER_S: nothing to load into a closing daemon
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        await runner.cleanup()
        await daemon.stop()
        if bound_socket and listen.socket_path is not None:
            with contextlib.suppress(FileNotFoundError):
                listen.socket_path.unlink()


async def _start_tcp(
    runner: web.AppRunner, daemon: Daemon, listen: Listen, options: HttpOptions
) -> str:
    """Refuse clear text beyond loopback (unless asked), listen (over TLS when given), and
    tell the daemon what it listens as (`health`; `--insecure-http` witnessed). The URL."""
    assert listen.tcp is not None
    try:
        host, port = parse_tcp(
            listen.tcp, tls=listen.tls is not None, insecure_http=listen.insecure_http
        )
    except ValueError as exc:
        raise TallyError(str(exc)) from None
    context = server_context(*listen.tls) if listen.tls is not None else None
    site = GatedTCPSite(runner, host, port, runner.app[GATE], ssl_context=context)
    await site.start()
    scheme = "https" if context is not None else "http"
    name = options.host_names[0] if options.host_names else host
    base = f"{scheme}://{host_form(name)}:{site.port}"
    cert = listen.tls[0] if listen.tls is not None else None
    await daemon.witness_listener(
        Listener(
            url=base,
            tls=context is not None,
            tls_fingerprint=fingerprint(cert.read_bytes()) if cert is not None else None,
            cert_path=str(cert) if cert is not None else None,
            insecure_http=context is None and listen.insecure_http,
            host_names=list(options.host_names),
        )
    )
    return base


def _say_stopping(daemon: Daemon) -> None:
    """What a stop (Ctrl-C, SIGTERM) does, said once, before the drain starts."""
    n = daemon.engine.in_flight()
    drain = daemon.settings.drain_s
    if n:
        message = (
            f"stopping: draining {n} run{'s' if n != 1 else ''}… (up to {drain:g} s; what is "
            "still running then is interrupted and `tally resume RUN` continues it)"
        )
    else:
        message = "stopping: no run in flight"
    log.warning(message)  # `tally serve` logs to stderr: this is the line Ctrl-C prints


def log_to_stderr(level: int = logging.INFO) -> None:
    logging.basicConfig(
        stream=sys.stderr, level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
