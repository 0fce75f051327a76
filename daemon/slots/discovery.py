"""Finding OpenAI-compatible model servers: what answers on a URL, and what it serves.

`tally models scan` probes the ports local servers usually listen on (loopback only) and any
URL the user names; `tally doctor` and the pool use the same small readers. Every body read
here comes from a server we do not control: it is size-capped, parsed defensively, and a
redirect is never followed (a loopback probe must not be sent elsewhere).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from pydantic import BaseModel

from daemon.intake import SMALL_BODY, loads, read_body

# The ports local OpenAI-compatible servers listen on by default, and what usually runs there.
USUAL_PORTS: tuple[tuple[int, str], ...] = (
    (11434, "Ollama"),
    (8080, "llama-server"),
    (1234, "LM Studio"),
    (8000, "vLLM"),
)
LOOPBACK = "127.0.0.1"
_BODY_CAP = SMALL_BODY  # a /v1/models or /props answer larger than this is not one
_MODELS_SHOWN = 50


def split_url(url: str) -> tuple[str, str]:
    """(server root, OpenAI base) from a URL given with or without its `/v1`."""
    url = url.strip().rstrip("/")
    if url.endswith("/v1"):
        return url[:-3], url
    return url, url + "/v1"


def normalize_url(text: str) -> str:
    """A user's server URL as an OpenAI base (`http://host:port/v1`); ValueError if unusable.

    `host:port` gets `http://`; a path other than `/v1` is kept (a proxy may mount the API
    elsewhere) and gets `/v1` appended only when it has none.
    """
    text = text.strip()
    if not text or any(c.isspace() for c in text):
        raise ValueError(f"not a URL: {text!r}")
    if "://" not in text:
        text = "http://" + text
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"{text}: only http:// and https:// servers are supported")
    if not parts.hostname:
        raise ValueError(f"{text}: no host")
    try:
        parts.port  # noqa: B018  (raises ValueError on a bad port)
    except ValueError:
        raise ValueError(f"{text}: bad port") from None
    if parts.query or parts.fragment or parts.username or parts.password:
        raise ValueError(f"{text}: a server URL has no query, fragment or credentials")
    return split_url(text)[1]


def connection_problem(exc: BaseException, url: str, timeout_s: float) -> str:
    """One line saying why `url` could not be asked."""
    if isinstance(exc, TimeoutError):
        return f"no answer from {url} within {timeout_s:g} s"
    if isinstance(exc, aiohttp.ServerFingerprintMismatch):
        got = "sha256:" + exc.got.hex()
        return f"{url}: its TLS certificate ({got}) is not the pinned tls_fingerprint"
    if isinstance(exc, aiohttp.ClientConnectorCertificateError):
        why = str(exc.certificate_error)[:150]
        return f"{url}: its TLS certificate does not verify ({why}): set tls_fingerprint or tls_ca"
    if isinstance(exc, aiohttp.ClientConnectorError):
        errno = exc.os_error.errno if exc.os_error else None
        why = os.strerror(errno) if errno and errno > 0 else str(exc.os_error or exc)
        return f"cannot connect to {url}: {why.lower()}"[:300]
    if isinstance(exc, aiohttp.ClientError):
        return f"{url}: {type(exc).__name__}: {exc}"[:300]
    return f"{url}: {exc!r}"[:300]


def read_props(props: Any) -> tuple[int | None, int | None]:
    """(total_slots, n_ctx per slot) from llama.cpp's /props, or None where it says nothing."""
    if not isinstance(props, dict):
        return None, None
    total = props.get("total_slots")
    settings = props.get("default_generation_settings") or {}
    n_ctx = settings.get("n_ctx") if isinstance(settings, dict) else None
    return (total if _count(total) else None, n_ctx if _count(n_ctx) else None)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value < 2**31


def model_ids(body: Any) -> list[str]:
    """The ids of an OpenAI `/v1/models` list (`{"data": [{"id": …}]}`): printable strings
    only (an id with a terminal escape would rewrite the screen that lists it), at most
    MAX_MODELS of them (1 MiB of answer is 70k tiny entries)."""
    data = body.get("data") if isinstance(body, dict) else None
    if not isinstance(data, list):
        return []
    ids = [m["id"] for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]
    return [i[:200] for i in ids if i and i.isprintable()][:MAX_MODELS]


MAX_MODELS = 1000


async def get_json(
    session: aiohttp.ClientSession,
    url: str,
    timeout_s: float,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any]:
    """GET without following redirects: (status, parsed JSON or None)."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with session.get(url, timeout=timeout, headers=headers, allow_redirects=False) as resp:
        if resp.status != 200:
            return resp.status, None
        try:
            return resp.status, loads(await read_body(resp, _BODY_CAP, url), url)
        except ValueError:  # over the cap, not JSON, or nested too deep
            return resp.status, None


class ServerFound(BaseModel):
    """What one probed URL answered."""

    url: str
    """The OpenAI base URL (`…/v1`), as a roster member's `url` takes it."""
    usual: str | None = None
    """What usually listens on this port (a hint, not a detection)."""
    found: bool
    kind: str | None = None
    """`llama.cpp` (it answers /props with slots), `ollama` (/api/version) or `openai`."""
    models: list[str] = []
    n_ctx: int | None = None
    """Context per slot (llama.cpp)."""
    total_slots: int | None = None
    latency_ms: int | None = None
    problem: str | None = None


async def probe_server(
    session: aiohttp.ClientSession,
    url: str,
    timeout_s: float,
    usual: str | None = None,
    headers: dict[str, str] | None = None,
) -> ServerFound:
    """Ask `url`'s /v1/models, then (llama.cpp) /props, or (Ollama) /api/version."""
    root, v1 = split_url(url)
    started = time.monotonic()
    try:
        status, body = await get_json(session, v1 + "/models", timeout_s, headers)
    except (aiohttp.ClientError, TimeoutError) as exc:
        problem = connection_problem(exc, v1 + "/models", timeout_s)
        return ServerFound(url=v1, usual=usual, found=False, problem=problem)
    latency = int((time.monotonic() - started) * 1000)
    if status != 200 or not isinstance(body, dict):
        why = f"answered {status}" if status != 200 else "answered something that is not JSON"
        return ServerFound(url=v1, usual=usual, found=False, problem=f"{v1}/models {why}")
    found = ServerFound(
        url=v1, usual=usual, found=True, kind="openai", models=model_ids(body), latency_ms=latency
    )
    try:
        status, props = await get_json(session, root + "/props", timeout_s, headers)
        total, n_ctx = read_props(props) if status == 200 else (None, None)
        if total is not None:
            found.kind, found.total_slots, found.n_ctx = "llama.cpp", total, n_ctx
        else:
            status, version = await get_json(session, root + "/api/version", timeout_s, headers)
            if status == 200 and isinstance(version, dict) and "version" in version:
                found.kind = "ollama"
    except (aiohttp.ClientError, TimeoutError):
        pass  # the models list is what counts; the rest is detail
    if len(found.models) > _MODELS_SHOWN:
        found.models = found.models[:_MODELS_SHOWN]
    return found


def scan_targets(
    ports: Sequence[int] | None = None, urls: Sequence[str] = ()
) -> list[tuple[str, str | None]]:
    """(OpenAI base URL, usual server) to probe: loopback ports (default: the usual ones),
    then the given URLs (normalized; ValueError on a bad one), without duplicates."""
    usual = dict(USUAL_PORTS)
    chosen = [p for p, _ in USUAL_PORTS] if ports is None else list(ports)
    targets = [(f"http://{LOOPBACK}:{p}/v1", usual.get(p)) for p in chosen]
    targets += [(normalize_url(u), None) for u in urls]
    first: dict[str, str | None] = {}
    for url, hint in targets:
        first.setdefault(url, hint)
    return list(first.items())


async def scan(targets: Sequence[tuple[str, str | None]], timeout_s: float) -> list[ServerFound]:
    """Probe every target at once; each answers within about 3 × `timeout_s`."""
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        return list(
            await asyncio.gather(
                *(probe_server(session, url, timeout_s, usual) for url, usual in targets)
            )
        )
