"""The console: a browser view of runs, the pool and the record, served at `/` on TCP.

Browsers cannot reach the unix socket, and a bearer token cannot live in a page safely, so a
browser signs in once: `tally console` asks the running daemon (over the socket, as its owner)
for a one-time code and prints `http://HOST:PORT/console/login#code=…` (a fragment: the code is
never in a request line, a log or a Referer). The code is good once, for two minutes.

The login page's own script POSTs the code (`POST /console/login`, the console's Origin, never a
cross-site navigation) and gets a session secret bound to a client (`console`, scope `read`;
`console-admin` with `--admin`; or a named client). The page keeps it in its origin's storage
and sends it in the `X-Tally-Session` header on every API call and SSE stream (read with
`fetch`, not `EventSource`, which cannot send headers). There is no cookie: browsers scope
cookies by host and not by port, so any other web server on loopback would receive one and
could set or overwrite it; a header secret is read and sent only by this origin's script, and
another origin can neither read it nor send the custom header without a CORS grant this daemon
never gives. The guard in `surfaces.access` accepts the secret where it would accept a bearer
token, with the same scopes; a request that carries it with an Origin must carry its own.

The pages are static files (plain HTML, CSS, ES modules; nothing built or fetched at run time;
served without a session: they hold no data) that read only through `POST /v1/tools/{name}`,
the run SSE stream, and the run feed below (`GET /v1/events`: the `run_feed` tool's answers
pushed, a coalesced `run` event per changed run), so they show nothing the API does not.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import re
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from daemon.clients import CLIENT_NAME, OWNER, Client
from daemon.errors import Forbidden, InvalidInput, NotFound
from surfaces.answers import error_response, sse_frame, validation_details
from surfaces.app import DAEMON, OPTIONS, STREAMS, client_of
from surfaces.connections import counted_stream

STATIC = Path(__file__).parent / "static"
HEADER = "X-Tally-Session"
"""The session secret's header: only the console's own script can send it (CORS)."""
CODE_TTL_S = 120.0
SESSION_TTL_S = 12 * 3600.0
MAX_SESSIONS = 256
LOGIN_PATH = "/console/login"
LOGOUT_PATH = "/console/logout"
_ASSET = re.compile(r"^[a-z0-9_-]{1,64}\.(js|css|html|svg)$")
_SECRET = re.compile(r"^[A-Za-z0-9_-]{16,128}$")


def public(path: str) -> bool:
    """Paths the guard lets through without a client: the static pages (they hold no data)
    and the login (it exchanges its own secret)."""
    return path == "/" or (path.startswith("/console/") and path != LOGOUT_PATH)


_TYPES = {
    "js": "text/javascript",
    "css": "text/css",
    "html": "text/html",
    "svg": "image/svg+xml",
}
# The pages load only their own files and talk only to this origin.
_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
    "img-src 'self' data:; connect-src 'self'; base-uri 'none'; form-action 'self'; "
    "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


@dataclass
class _Grant:
    client: Client
    named: bool  # bound to a named client: it ends when that client is revoked
    expires: float


@dataclass
class Sessions:
    """One-time codes and the sessions they became (in memory: a restart signs everyone out)."""

    codes: dict[str, _Grant] = field(default_factory=dict)
    sessions: dict[str, _Grant] = field(default_factory=dict)
    base: str | None = None
    """The TCP listener's URL (`http://127.0.0.1:PORT`), once it listens."""

    def mint(self, client: Client, named: bool) -> str:
        now = time.monotonic()
        self.codes = {k: g for k, g in self.codes.items() if g.expires > now}
        if len(self.codes) >= MAX_SESSIONS:
            raise Forbidden("too many unused console codes; wait two minutes")
        code = secrets.token_urlsafe(24)
        self.codes[_digest(code)] = _Grant(client, named, now + CODE_TTL_S)
        return code

    def exchange(self, code: str) -> tuple[str, _Grant] | None:
        """A session secret for a valid code, which is then spent (None: unknown, used,
        expired). Only the digest of either is kept."""
        grant = self.codes.pop(_digest(code), None)
        now = time.monotonic()
        if grant is None or grant.expires <= now:
            return None
        self.sessions = {k: g for k, g in self.sessions.items() if g.expires > now}
        while len(self.sessions) >= MAX_SESSIONS:  # the oldest session goes first
            self.sessions.pop(next(iter(self.sessions)))
        secret = secrets.token_urlsafe(32)
        session = _Grant(grant.client, grant.named, now + SESSION_TTL_S)
        self.sessions[_digest(secret)] = session
        return secret, session

    def lookup(self, secret: str) -> _Grant | None:
        grant = self.sessions.get(_digest(secret))  # a 256-bit secret's digest: no timing oracle
        if grant is None:
            return None
        if grant.expires <= time.monotonic():
            del self.sessions[_digest(secret)]
            return None
        return grant

    def end(self, secret: str) -> bool:
        return self.sessions.pop(_digest(secret), None) is not None


SESSIONS = web.AppKey("console_sessions", Sessions)


def session_secret(request: web.Request) -> str | None:
    """The session secret the request carries in its header, if it is well-formed."""
    secret = request.headers.get(HEADER)
    return secret if secret is not None and _SECRET.match(secret) else None


def session_client(request: web.Request, known: set[str]) -> tuple[Client, str] | None:
    """The client of the request's console session and the key its SSE streams count under
    (one per session: every `console` session shares a client name), if it holds a live one.

    `known` names the named clients that still exist (a revoked one's sessions end with it).
    """
    secret = session_secret(request)
    if secret is None:
        return None
    grant = request.app[SESSIONS].lookup(secret)
    if grant is None or (grant.named and grant.client.name not in known):
        return None
    return grant.client, f"session:{_digest(secret)[:16]}"


def same_origin(request: web.Request) -> bool:
    """The request comes from the console's own page (its Origin names this listener)."""
    # `request.scheme` is https on a TLS listener: its page's origin is https://name:port
    return request.headers.get("Origin") == f"{request.scheme}://{request.headers.get('Host', '')}"


def cross_site(request: web.Request) -> bool:
    """A browser says the request comes from another site (another port of this host is the
    same *site* but not the same origin): `Sec-Fetch-Site` other than `same-origin` (the
    console's own script) or `none` (typed, pasted or opened by `tally console --open`)."""
    return request.headers.get("Sec-Fetch-Site", "none") not in ("same-origin", "none")


# ---------------------------------------------------------------- login


class CodeIn(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    admin: bool = Field(default=False, description="Bind the session to scope admin.")
    client: str | None = Field(
        default=None, pattern=CLIENT_NAME, description="Bind it to this named client instead."
    )


async def mint_code(request: web.Request) -> web.Response:
    """POST /v1/console/code (admin: the socket's owner): a one-time console login URL."""
    caller = client_of(request)
    if caller is None or not caller.allows("admin"):
        return error_response(403, "forbidden", "a console login code needs scope 'admin'")
    try:
        data = CodeIn.model_validate_json((await request.read()) or b"{}")
    except ValidationError as exc:
        return error_response(422, "invalid_input", "invalid arguments", validation_details(exc))
    named = data.client is not None
    if data.client is not None:
        record = next(
            (r for r in request.app[DAEMON].clients.records() if r.name == data.client), None
        )
        if record is None:
            raise NotFound(f"no client named {data.client!r} (see `tally client list`)")
        client = Client(record.name, record.scope)
    else:
        client = Client("console-admin", "admin") if data.admin else Client("console", "read")
    sessions = request.app[SESSIONS]
    if sessions.base is None:
        raise InvalidInput("the daemon has no TCP listener: start it with `tally serve --tcp`")
    code = sessions.mint(client, named)
    return web.json_response(
        {
            "url": f"{sessions.base}{LOGIN_PATH}#code={code}",
            "client": client.name,
            "scope": client.scope,
            "expires_in_s": int(CODE_TTL_S),
        }
    )


_PLAIN = {"Content-Type": "text/plain; charset=utf-8", **_HEADERS}
_PRIVATE = {**_HEADERS, "Cache-Control": "no-store"}


class LoginIn(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    code: str = Field(min_length=1, max_length=200)


def _cross_site_refusal() -> web.Response:
    return web.Response(
        status=403,
        text="A console login must be opened directly (paste the URL `tally console` printed, "
        "or use `tally console --open`), not reached from another page.\n",
        headers=_PLAIN,
    )


async def login_page(request: web.Request) -> web.StreamResponse:
    """GET /console/login: the page whose script POSTs the code from its URL's fragment.

    Changes nothing: a navigation from another site (another local port included) is refused
    before the page, and so before its script, can run."""
    if cross_site(request):
        return _cross_site_refusal()
    return web.FileResponse(STATIC / "login.html", headers=_PRIVATE)


async def login(request: web.Request) -> web.Response:
    """POST /console/login `{"code"}` from the login page: the session secret, once."""
    if cross_site(request) or not same_origin(request):
        return error_response(
            403, "forbidden_origin", "a console login must come from the console's own page"
        )
    try:
        data = LoginIn.model_validate_json(await request.read())
    except ValidationError:
        return error_response(400, "bad_request", 'the body must be {"code": "..."}')
    exchanged = request.app[SESSIONS].exchange(data.code)
    if exchanged is None:
        return error_response(
            401, "unauthorized", "this login code is unknown, used or expired: run `tally console`"
        )
    secret, grant = exchanged
    return web.json_response(
        {"session": secret, **_whoami(grant.client, grant.expires)}, headers=_PRIVATE
    )


def _whoami(client: Client, expires: float) -> dict[str, Any]:
    return {
        "client": client.name,
        "scope": client.scope,
        "expires_in_s": max(0, int(expires - time.monotonic())),
    }


async def whoami(request: web.Request) -> web.Response:
    """GET /v1/console/session: who this session is, so the page offers only what it may do."""
    client = client_of(request)
    secret = session_secret(request)
    grant = request.app[SESSIONS].lookup(secret) if secret is not None else None
    if client is None:  # the guard resolved nobody (an unauthenticated TCP request)
        raise web.HTTPUnauthorized(reason="no session")
    expires = grant.expires if grant is not None else time.monotonic()
    body = _whoami(client, expires)
    if grant is None:
        body["expires_in_s"] = None  # a bearer token or the socket: no session to expire
    return web.json_response(body, headers=_PRIVATE)


async def logout(request: web.Request) -> web.Response:
    """POST /console/logout: ends the session whose secret the header carries (the guard has
    checked it and its Origin already: nobody else can end it)."""
    secret = session_secret(request)
    ended = secret is not None and request.app[SESSIONS].end(secret)
    return web.json_response({"ended": ended}, headers=_PRIVATE)


# ---------------------------------------------------------------- pages


async def index(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC / "index.html", headers=_HEADERS)


async def asset(request: web.Request) -> web.FileResponse:
    name = request.match_info["name"]
    match = _ASSET.match(name)
    path = STATIC / name
    if match is None or not path.is_file():
        raise web.HTTPNotFound(reason=f"no console file {name!r}")
    headers = {**_HEADERS, "Content-Type": f"{_TYPES[match.group(1)]}; charset=utf-8"}
    return web.FileResponse(path, headers=headers)


# ---------------------------------------------------------------- the run feed


async def run_feed(request: web.Request) -> web.StreamResponse:
    """GET /v1/events: the `run_feed` tool's answers, pushed. A `run` event (its RunSummaryOut)
    whenever a run changes; `ready` when the stream starts and again when the feed cannot go on
    from where it was (the page lists the runs afresh on it)."""
    from daemon.tools import TOOLS, ToolContext
    from daemon.tools.console import RunFeedIn, changed

    app = request.app
    daemon = app[DAEMON]
    feed = TOOLS["run_feed"]
    ctx = ToolContext(client=client_of(request) or OWNER)
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)
    stop = asyncio.Event()
    app[STREAMS].stops.add(stop)
    stopped = asyncio.ensure_future(stop.wait())
    waiting: asyncio.Future[bool] | None = None
    try:
        cursor = (await feed.handler(daemon, RunFeedIn(), ctx)).cursor
        await resp.write(b"retry: 1000\n\nevent: ready\ndata: {}\n\n")
        while True:
            waiting = asyncio.ensure_future(changed(daemon, cursor, app[OPTIONS].keepalive_s))
            await asyncio.wait({waiting, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if stopped.done():
                break
            if not waiting.result():
                await resp.write(b": keep-alive\n\n")
                continue
            more = True
            while more:
                out = await feed.handler(daemon, RunFeedIn(after=cursor), ctx)
                cursor, more = out.cursor, out.more
                if out.reset:  # the page lists the runs afresh, then follows from here
                    await resp.write(b"event: ready\ndata: {}\n\n")
                if out.runs:  # one write per batch: a slow reader holds back only its stream
                    frames = (sse_frame("run", run.model_dump(mode="json")) for run in out.runs)
                    await resp.write(b"".join(frames))
    except (ConnectionResetError, asyncio.CancelledError):
        pass
    finally:
        app[STREAMS].stops.discard(stop)
        stopped.cancel()
        if waiting is not None:
            waiting.cancel()
    with contextlib.suppress(ConnectionResetError):
        await resp.write_eof()
    return resp


def register(app: web.Application) -> None:
    app[SESSIONS] = Sessions()
    app.router.add_get("/", index)
    app.router.add_get(LOGIN_PATH, login_page)
    app.router.add_post(LOGIN_PATH, login)
    app.router.add_post(LOGOUT_PATH, logout)
    app.router.add_get("/v1/console/session", whoami)
    app.router.add_get("/console/{name}", asset)
    app.router.add_post("/v1/console/code", mint_code)
    app.router.add_get("/v1/events", counted_stream(run_feed))


def set_base(app: web.Application, base: str) -> None:
    """Where the TCP listener is, so login URLs can name it."""
    app[SESSIONS].base = base
