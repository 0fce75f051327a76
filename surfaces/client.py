"""The daemon's HTTP client, shared by the CLI and the MCP adapter.

Finds the daemon without XDG_RUNTIME_DIR (IDE launchers pass a sparse environment):
$TALLY_URL (+ $TALLY_TOKEN) for TCP, else $TALLY_SOCKET, else the default socket path.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import aiohttp

from daemon.config import default_socket_path


def start_hint() -> str:
    """How to start the daemon: the installed unit's `systemctl` line if there is one."""
    from surfaces.units import installed

    unit = installed()
    return (
        f"`{unit}` or `tally serve`" if unit else "`tally serve` (or install a unit: `tally unit`)"
    )


def not_running() -> str:
    return f"tally daemon is not running — start it with {start_hint()}"


class DaemonDown(Exception):
    def __init__(self, where: str, reason: str | None = None) -> None:
        # A URL (TALLY_URL) may name a daemon on another machine that runs but cannot be
        # reached (a name that does not resolve, a firewall): say why, not "start it".
        if reason is not None:
            super().__init__(f"cannot reach the tally daemon at {where}: {reason}")
        else:
            super().__init__(f"{not_running()} (looked for it at {where})")
        self.where = where
        self.remote = reason is not None


class DaemonError(Exception):
    """An error answer from the daemon: `{"error": {"code", "message", "details"}}`."""

    def __init__(self, status: int, code: str, message: str, details: Any = None) -> None:
        super().__init__(f"{code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.details = details or {}


@dataclass(frozen=True)
class Endpoint:
    socket_path: Path | None = None
    url: str | None = None
    token: str | None = None
    # an https daemon's certificate: pinned (`sha256:…`, TALLY_TLS_FINGERPRINT) or verified
    # against a CA bundle (TALLY_CACERT); neither = the system's CAs
    tls_fingerprint: str | None = None
    tls_ca: Path | None = None

    @classmethod
    def from_env(cls, socket_path: Path | None = None) -> Endpoint:
        if socket_path is None and os.environ.get("TALLY_URL"):
            return cls(
                url=os.environ["TALLY_URL"].rstrip("/"),
                token=os.environ.get("TALLY_TOKEN"),
                tls_fingerprint=os.environ.get("TALLY_TLS_FINGERPRINT") or None,
                tls_ca=Path(os.environ["TALLY_CACERT"]) if os.environ.get("TALLY_CACERT") else None,
            )
        env = os.environ.get("TALLY_SOCKET")
        return cls(socket_path=socket_path or (Path(env) if env else default_socket_path()))

    @property
    def where(self) -> str:
        return self.url or f"unix:{self.socket_path}"


@dataclass(frozen=True)
class SseEvent:
    id: str | None
    event: str
    data: Any


class DaemonClient:
    """One keep-alive session to the daemon. Use as `async with DaemonClient(endpoint) as c`."""

    def __init__(self, endpoint: Endpoint, *, timeout: float | None = None) -> None:
        self.endpoint = endpoint
        self._timeout = timeout
        self._session: aiohttp.ClientSession | None = None

    @property
    def base(self) -> str:
        return self.endpoint.url or "http://tally"

    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector: aiohttp.BaseConnector
            if self.endpoint.url:
                from daemon.tls import FINGERPRINT, client_ssl

                pin = self.endpoint.tls_fingerprint
                if pin is not None and not FINGERPRINT.match(pin):
                    raise DaemonError(
                        0,
                        "bad_fingerprint",
                        "TALLY_TLS_FINGERPRINT must be sha256: + 64 hex digits",
                    )
                check = client_ssl(pin, self.endpoint.tls_ca)
                connector = aiohttp.TCPConnector(limit=64, ssl=check)
            else:
                connector = aiohttp.UnixConnector(path=str(self.endpoint.socket_path), limit=64)
            headers = {}
            if self.endpoint.token:
                headers["Authorization"] = f"Bearer {self.endpoint.token}"
            self._session = aiohttp.ClientSession(
                connector=connector,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=self._timeout),
            )
        return self._session

    async def __aenter__(self) -> DaemonClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def call(self, tool: str, arguments: dict[str, Any] | None = None) -> dict[str, Any]:
        """POST /v1/tools/{tool}; raises DaemonDown or DaemonError."""
        try:
            async with self.session().post(
                f"{self.base}/v1/tools/{tool}", json=arguments or {}
            ) as resp:
                return await _json_or_raise(resp)
        except (aiohttp.ClientConnectionError, FileNotFoundError, ConnectionRefusedError) as exc:
            if isinstance(exc, aiohttp.ServerDisconnectedError):
                raise DaemonError(503, "disconnected", "the daemon closed the connection") from None
            if isinstance(exc, aiohttp.ServerFingerprintMismatch):
                got = "sha256:" + exc.got.hex()
                message = f"{self.endpoint.where} presents a certificate ({got}) that is not "
                raise DaemonError(0, "tls", message + "TALLY_TLS_FINGERPRINT") from None
            if isinstance(exc, aiohttp.ClientSSLError):
                message = f"TLS with {self.endpoint.where} failed: {exc} (pin its certificate: "
                raise DaemonError(0, "tls", message + "TALLY_TLS_FINGERPRINT)") from None
            reason = (str(exc) or type(exc).__name__) if self.endpoint.url else None
            raise DaemonDown(self.endpoint.where, reason) from None

    async def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST JSON to a route that is not a tool (e.g. /v1/console/code)."""
        try:
            async with self.session().post(f"{self.base}{path}", json=body) as resp:
                return await _json_or_raise(resp)
        except (aiohttp.ClientConnectionError, FileNotFoundError, ConnectionRefusedError):
            raise DaemonDown(self.endpoint.where) from None

    async def get_text(self, path: str) -> str:
        try:
            async with self.session().get(f"{self.base}{path}") as resp:
                if resp.status != 200:
                    await _json_or_raise(resp)
                return await resp.text()
        except (aiohttp.ClientConnectionError, FileNotFoundError, ConnectionRefusedError):
            raise DaemonDown(self.endpoint.where) from None

    async def ping(self) -> bool:
        try:
            await self.get_text("/healthz")
        except (DaemonDown, DaemonError):
            return False
        return True

    async def events(self, run_id: str, after: str | None = None) -> AsyncGenerator[SseEvent, None]:
        """Follow a run's SSE stream to its end, resuming with Last-Event-ID on a dropped link."""
        last = after
        retries = 0
        while True:
            headers = {"Last-Event-ID": last} if last is not None else {}
            try:
                async with self.session().get(
                    f"{self.base}/v1/runs/{run_id}/events",
                    headers=headers,
                    timeout=aiohttp.ClientTimeout(total=None, sock_read=None),
                ) as resp:
                    if resp.status != 200:
                        await _json_or_raise(resp)
                    overrun = False
                    async for event in _parse_sse(resp.content):
                        retries = 0
                        if event.id is not None:
                            last = event.id
                        if event.event == "end":
                            return
                        if event.event == "overrun":  # we read too slowly: resume from `last`
                            overrun = True
                            break
                        yield event
                if not overrun:
                    return
            except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError):
                retries += 1
                if retries > 3:
                    raise DaemonError(503, "disconnected", "lost the event stream") from None
                await asyncio.sleep(0.2 * retries)
            except (aiohttp.ClientConnectionError, FileNotFoundError, ConnectionRefusedError):
                raise DaemonDown(self.endpoint.where) from None


async def _json_or_raise(resp: aiohttp.ClientResponse) -> dict[str, Any]:
    text = await resp.text()
    try:
        body = json.loads(text) if text else {}
    except (ValueError, RecursionError):
        body = {}
    if resp.status == 200 and isinstance(body, dict):
        return body
    err = body.get("error") if isinstance(body, dict) else None
    if isinstance(err, dict):
        raise DaemonError(
            resp.status,
            str(err.get("code", "error")),
            str(err.get("message", "")),
            err.get("details"),
        )
    raise DaemonError(resp.status, "http_error", f"HTTP {resp.status}: {text[:200]}")


async def _parse_sse(content: aiohttp.StreamReader) -> AsyncIterator[SseEvent]:
    ident: str | None = None
    kind = "message"
    data: list[str] = []
    async for raw in content:
        line = raw.decode("utf-8").rstrip("\r\n")
        if not line:
            if data:
                payload = "\n".join(data)
                try:
                    value: Any = json.loads(payload)
                except (ValueError, RecursionError):  # the daemon's bytes are still bytes
                    value = payload
                yield SseEvent(ident, kind, value)
            ident, kind, data = None, "message", []
            continue
        if line.startswith(":"):
            continue
        field, _, value_text = line.partition(":")
        value_text = value_text.removeprefix(" ")
        if field == "id":
            ident = value_text
        elif field == "event":
            kind = value_text
        elif field == "data":
            data.append(value_text)


def run_client(main: Any) -> int:
    """Run a CLI coroutine; a missing daemon or an error answer is one line on stderr, exit 1."""
    import sys

    try:
        code: int = asyncio.run(main)
    except DaemonDown as exc:
        print(
            f"tally: {exc}"
            if exc.remote
            else f"tally: daemon not running at {exc.where}; start it with {start_hint()}",
            file=sys.stderr,
        )
        return 1
    except DaemonError as exc:
        print(f"tally: {exc.code}: {exc.message}", file=sys.stderr)
        for err in (
            (exc.details or {}).get("errors", [])[:10] if isinstance(exc.details, dict) else []
        ):
            if isinstance(err, dict):
                loc = ".".join(str(p) for p in err.get("loc", []))
                print(f"  {loc}: {err.get('msg', err)}", file=sys.stderr)
        return 2 if exc.status == 422 else 1
    return code
