"""The console: a browser view of runs, the pool and the record, served at `/` on TCP.

Browsers cannot reach the unix socket, and a bearer token cannot live in a page safely, so a
browser signs in once: `tally console` asks the running daemon (over the socket, as its owner)
for a one-time code and prints `http://HOST:PORT/console/login?code=…`. The code is good once,
for two minutes; exchanging it sets an HttpOnly, SameSite=Strict session cookie bound to a
client (`console`, scope `read`; `console-admin` with `--admin`; or a named client). The guard in
`surfaces.http` accepts that cookie where it would accept a bearer token, with the same scopes,
and a POST carried by the cookie needs an `Origin` equal to the page's own (no cross-site forms).

The pages are static files (plain HTML, CSS, ES modules; nothing built or fetched at run time)
that read only through `POST /v1/tools/{name}`, the run SSE stream, and the run feed below
(`GET /v1/events`: a coalesced `run` event per changed run), so they show nothing the API does
not.
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
from typing import TYPE_CHECKING, Any

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from daemon.clients import CLIENT_NAME, Client
from daemon.errors import Forbidden, InvalidInput, NotFound
from daemon.runs.state import TASK_ENDED

if TYPE_CHECKING:
    from daemon.runs.engine import Engine
    from daemon.runs.ports import EntryLike
    from daemon.runs.state import RunView

STATIC = Path(__file__).parent / "static"
COOKIE = "tally_session"
CODE_TTL_S = 120.0
SESSION_TTL_S = 12 * 3600.0
MAX_SESSIONS = 256
LOGIN_PATH = "/console/login"
PUBLIC = frozenset({LOGIN_PATH})
"""Paths the guard lets through without a client (the login exchanges its own secret)."""
_ASSET = re.compile(r"^[a-z0-9_-]{1,64}\.(js|css|html|svg)$")
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
    feed: RunFeed | None = None
    """The run feed, made on first use (the engine exists only once the daemon started)."""

    def mint(self, client: Client, named: bool) -> str:
        now = time.monotonic()
        self.codes = {k: g for k, g in self.codes.items() if g.expires > now}
        if len(self.codes) >= MAX_SESSIONS:
            raise Forbidden("too many unused console codes; wait two minutes")
        code = secrets.token_urlsafe(24)
        self.codes[_digest(code)] = _Grant(client, named, now + CODE_TTL_S)
        return code

    def exchange(self, code: str) -> str | None:
        """A session id for a valid code, which is then spent (None: unknown, used, expired)."""
        grant = self.codes.pop(_digest(code), None)
        now = time.monotonic()
        if grant is None or grant.expires <= now:
            return None
        self.sessions = {k: g for k, g in self.sessions.items() if g.expires > now}
        while len(self.sessions) >= MAX_SESSIONS:  # the oldest session goes first
            self.sessions.pop(next(iter(self.sessions)))
        session = secrets.token_urlsafe(32)
        self.sessions[_digest(session)] = _Grant(grant.client, grant.named, now + SESSION_TTL_S)
        return session

    def lookup(self, session: str) -> _Grant | None:
        grant = self.sessions.get(_digest(session))
        if grant is None:
            return None
        if grant.expires <= time.monotonic():
            del self.sessions[_digest(session)]
            return None
        return grant


SESSIONS = web.AppKey("console_sessions", Sessions)


def cookie_client(request: web.Request, known: set[str]) -> Client | None:
    """The client of the request's console session cookie, if it holds a live one.

    `known` names the named clients that still exist (a revoked one's sessions end with it).
    """
    session = request.cookies.get(COOKIE)
    if not session or len(session) > 200:
        return None
    grant = request.app[SESSIONS].lookup(session)
    if grant is None or (grant.named and grant.client.name not in known):
        return None
    return grant.client


def same_origin(request: web.Request) -> bool:
    """A cookie-borne POST must come from the console's own page (CSRF)."""
    return request.headers.get("Origin") == f"http://{request.headers.get('Host', '')}"


# ---------------------------------------------------------------- login


class CodeIn(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    admin: bool = Field(default=False, description="Bind the session to scope admin.")
    client: str | None = Field(
        default=None, pattern=CLIENT_NAME, description="Bind it to this named client instead."
    )


async def mint_code(request: web.Request) -> web.Response:
    """POST /v1/console/code (admin: the socket's owner): a one-time console login URL."""
    from surfaces.http import DAEMON, client_of, error_response, validation_details

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
            "url": f"{sessions.base}{LOGIN_PATH}?code={code}",
            "client": client.name,
            "scope": client.scope,
            "expires_in_s": int(CODE_TTL_S),
        }
    )


_PLAIN = {"Content-Type": "text/plain; charset=utf-8", **_HEADERS}


async def login(request: web.Request) -> web.Response:
    code = request.query.get("code", "")
    session = request.app[SESSIONS].exchange(code) if 0 < len(code) <= 200 else None
    if session is None:
        return web.Response(
            status=401,
            text="This login code is unknown, used or expired: run `tally console` again.\n",
            headers=_PLAIN,
        )
    response = web.HTTPSeeOther("/", headers=_HEADERS)
    response.set_cookie(
        COOKIE,
        session,
        max_age=int(SESSION_TTL_S),
        path="/",
        httponly=True,
        samesite="Strict",
    )
    raise response


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


def run_summary(view: RunView) -> dict[str, Any]:
    """What the runs page lists (every field is also in `run_get`)."""
    return {
        "id": view.id,
        "state": view.state,
        "lane": view.lane,
        "lanes": list(dict.fromkeys(t.lane for t in view.tasks)),  # a plan's: what to show
        "client": view.client,
        "request": view.request[:200],
        "tasks_total": len(view.tasks),
        "tasks_done": sum(t.state in TASK_ENDED for t in view.tasks),
        "created_at_us": view.created_at_us,
        "updated_at_us": view.updated_at_us,
        "spent": view.spent.model_dump(),
    }


FLUSH_S = 0.2
"""Run changes are coalesced this long: a busy run costs a feed one frame per tick."""
BACKLOG = 256
"""Frames a slow reader may fall behind before its stream is closed (it reconnects)."""


class RunFeed:
    """Changed runs, one frame each per tick, built once and handed to every open stream."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.streams: set[asyncio.Queue[bytes | None]] = set()  # unbounded: see _flush
        self.dirty: dict[str, None] = {}
        self._unwatch: Any = None
        self._timer: asyncio.TimerHandle | None = None

    def open(self) -> asyncio.Queue[bytes | None]:
        queue: asyncio.Queue[bytes | None] = asyncio.Queue()
        self.streams.add(queue)
        if self._unwatch is None:
            unwatch = self.engine.watch(self._changed)
            unnudge = self.engine.feed.nudge(self._nudged)  # a wait for a slot: no entry
            self._unwatch = lambda: (unwatch(), unnudge())
        return queue

    def close(self, queue: asyncio.Queue[bytes | None]) -> None:
        self.streams.discard(queue)
        if not self.streams and self._unwatch is not None:
            self._unwatch()
            self._unwatch = None

    def _changed(self, entry: EntryLike, body: dict[str, Any]) -> None:
        self._nudged(str(entry.run))

    def _nudged(self, run_id: str) -> None:
        self.dirty[run_id] = None
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(FLUSH_S, self._flush)

    def _flush(self) -> None:
        from surfaces.http import sse_frame

        self._timer = None
        runs, self.dirty = list(self.dirty), {}
        frames = []
        for run in runs:
            with contextlib.suppress(NotFound):
                shown = self.engine.shown(self.engine.get(run))  # queued/waiting for a slot
                frames.append(sse_frame("run", run_summary(shown)))
        for queue in list(self.streams):
            if queue.qsize() + len(frames) > BACKLOG:  # too far behind: end it; it reconnects
                self.streams.discard(queue)
                while not queue.empty():
                    queue.get_nowait()
                queue.put_nowait(None)
                continue
            for frame in frames:
                queue.put_nowait(frame)


async def run_feed(request: web.Request) -> web.StreamResponse:
    """GET /v1/events: a `run` event (the run's summary) whenever a run changes."""
    from surfaces.http import DAEMON, OPTIONS, STREAMS

    app = request.app
    state = app[SESSIONS]
    if state.feed is None:
        state.feed = RunFeed(app[DAEMON].engine)
    feed = state.feed
    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await resp.prepare(request)
    stop = asyncio.Event()
    app[STREAMS].stops.add(stop)
    queue = feed.open()
    stopped = asyncio.ensure_future(stop.wait())
    try:
        await resp.write(b"retry: 1000\n\nevent: ready\ndata: {}\n\n")
        while True:
            getting = asyncio.ensure_future(queue.get())
            done, _ = await asyncio.wait(
                {getting, stopped},
                timeout=app[OPTIONS].keepalive_s,
                return_when=asyncio.FIRST_COMPLETED,
            )
            if getting not in done:
                getting.cancel()
                if stopped in done:
                    break
                await resp.write(b": keep-alive\n\n")
                continue
            frame = getting.result()
            if frame is None:
                break
            await resp.write(frame)
    except (ConnectionResetError, asyncio.CancelledError):
        pass
    finally:
        feed.close(queue)
        app[STREAMS].stops.discard(stop)
        stopped.cancel()
    with contextlib.suppress(ConnectionResetError):
        await resp.write_eof()
    return resp


def register(app: web.Application) -> None:
    app[SESSIONS] = Sessions()
    app.router.add_get("/", index)
    app.router.add_get(LOGIN_PATH, login)
    app.router.add_get("/console/{name}", asset)
    app.router.add_post("/v1/console/code", mint_code)
    app.router.add_get("/v1/events", run_feed)


def set_base(app: web.Application, base: str) -> None:
    """Where the TCP listener is, so login URLs can name it."""
    app[SESSIONS].base = base
