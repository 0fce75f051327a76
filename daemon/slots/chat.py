"""OpenAI-compatible `/v1/chat/completions` over one shared aiohttp session.

Streaming reads Server-Sent Events up to `data: [DONE]`, asking for the final usage chunk; a
stream that ends with neither [DONE] nor a finish_reason was cut short and is an error.
Any exception while a request is open (including cancellation) closes its connection rather
than returning it to the pool, so llama-server notices and stops generating.

What a member sends is bounded (daemon.intake): a reply's bytes (non-streamed: the body;
streamed: every line, and the text and tool-call fragments kept) by `reply_cap` — the
request's `max_tokens` times REPLY_TOKEN_BYTES plus REPLY_OVERHEAD, at most the member's
`max_reply_mb` — an SSE line by the same cap (at most MAX_LINE), a GET's answer by
SMALL_BODY, an embeddings answer by the ceiling; JSON nesting by MAX_DEPTH. Past a bound the
call fails with `BadReply` (502). A redirect is never followed (BadReply too): it would carry
the prompt wherever the member says.
"""

from __future__ import annotations

import contextlib
import inspect
import socket
import ssl
import struct
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

import aiohttp
from aiohttp.http_exceptions import LineTooLong

from daemon.intake import SMALL_BODY, Malformed, TooLarge, loads, read_body
from daemon.slots.errors import BadReply, ConsumerGone, ModelError, ReplyTooLarge
from daemon.slots.records import Usage
from roster import Member

_MIN_LINE = 128 * 1024  # aiohttp's own default bound on a line

OnDelta = Callable[[str], object]
OnChunk = Callable[[dict[str, Any]], object]
"""Called with each streamed chunk as parsed (a gateway relays them to its own client)."""

REMOTE_SEQ = "X-Tally-Seq"
REMOTE_CHECKPOINT = "X-Tally-Checkpoint"

REPLY_TOKEN_BYTES = 4096
"""What one generated token may cost in a reply: its text JSON-escaped (up to 6 bytes a
character), and with `logprobs` its 20 alternatives — generous, so no honest reply meets it."""
REPLY_OVERHEAD = 64 * 1024
"""The rest of a reply: ids, usage, timings, the finish reason."""
DEFAULT_CEILING = 16 * 2**20
"""A member's `max_reply_mb` default, in bytes."""
MAX_TOOL_CALLS = 128
"""The most tool calls one streamed reply may hold (a delta without an index opens a new one)."""
_CALL_BYTES = 64  # what an opened tool call counts against the cap, its fields empty
_LINE_COST = 32  # what a stream's line counts against the cap besides its bytes
MAX_LINE = 4 * 2**20
"""The longest SSE line read (a chunk carrying a whole tool call may be long)."""


def reply_cap(body: Mapping[str, Any], ceiling: int = DEFAULT_CEILING) -> int:
    """The byte cap of the reply to `body`: its max_tokens × REPLY_TOKEN_BYTES + REPLY_OVERHEAD,
    at most `ceiling` (a request that names no max_tokens gets the ceiling)."""
    asked = body.get("max_completion_tokens") or body.get("max_tokens")
    if not isinstance(asked, int) or isinstance(asked, bool) or asked <= 0:
        return ceiling
    return min(ceiling, REPLY_OVERHEAD + asked * REPLY_TOKEN_BYTES)


def request_body(
    member: Member,
    id_slot: int | None,
    messages: list[dict[str, Any]],
    *,
    max_tokens: int,
    response_format: dict[str, Any] | None,
    stream: bool,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": member.model_id or member.name,
        "messages": messages,
        "max_tokens": max_tokens,
        "cache_prompt": True,
        "stream": stream,
    }
    if id_slot is not None:
        body["id_slot"] = id_slot
    body.update(member.sampling.model_dump(exclude_none=True))
    if response_format is not None:
        body["response_format"] = response_format
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


def _tokens(value: Any) -> int:
    """A token count a member reported: a whole number in the ledger's range, else 0."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**53:
        return value
    return 0


def parse_usage(raw: Any) -> Usage:
    if not isinstance(raw, dict):
        return Usage()
    details = raw.get("prompt_tokens_details") or {}
    return Usage(
        prompt_tokens=_tokens(raw.get("prompt_tokens")),
        completion_tokens=_tokens(raw.get("completion_tokens")),
        cached_tokens=_tokens(details.get("cached_tokens")) if isinstance(details, dict) else 0,
    )


class Completion:
    """What came back: text, finish reason, usage, llama.cpp timings, model.

    Also what a relay needs to answer in OpenAI's shape: the whole JSON of a non-streamed
    reply (`whole`), the id, creation time and tool calls of a streamed one, and — when the
    server is another tally daemon's gateway — its ledger seq and checkpoint size (`remote`).
    """

    __slots__ = (
        "created",
        "finish_reason",
        "id",
        "model",
        "remote",
        "text",
        "timings",
        "tool_calls",
        "usage",
        "whole",
    )

    def __init__(self) -> None:
        self.text = ""
        self.finish_reason: str | None = None
        self.usage = Usage()
        self.timings: dict[str, Any] = {}
        self.model: str | None = None
        self.whole: dict[str, Any] | None = None
        self.id: str | None = None
        self.created: int | None = None
        self.tool_calls: list[dict[str, Any]] = []
        self.remote: dict[str, int] | None = None

    def response(self) -> dict[str, Any]:
        """The reply as one OpenAI `chat.completion` object (built from chunks if streamed)."""
        if self.whole is not None:
            return self.whole
        message: dict[str, Any] = {"role": "assistant", "content": self.text}
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        usage = self.usage
        return {
            "id": self.id or "chatcmpl-tally",
            "object": "chat.completion",
            "created": self.created or 0,
            "model": self.model or "",
            "choices": [{"index": 0, "message": message, "finish_reason": self.finish_reason}],
            "usage": {
                "prompt_tokens": usage.prompt_tokens,
                "completion_tokens": usage.completion_tokens,
                "total_tokens": usage.total_tokens,
                "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
            },
        }


class ChatClient:
    """Holds the pool's one ClientSession (created on first use, on the running loop)."""

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None
        # How each https origin's certificate is checked (a member's `tls_fingerprint` or
        # `tls_ca`); other origins get aiohttp's default (the system's CAs).
        self._tls: dict[str, ssl.SSLContext | aiohttp.Fingerprint | bool] = {}

    def pin(self, url: str, check: ssl.SSLContext | aiohttp.Fingerprint | bool) -> None:
        """Check `url`'s origin's certificate with `check` on every call to it."""
        self._tls[_origin(url)] = check

    def _ssl(self, url: str) -> ssl.SSLContext | aiohttp.Fingerprint | bool:
        return self._tls.get(_origin(url), True) if self._tls else True

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30)
            self._session = aiohttp.ClientSession(
                connector=connector, timeout=aiohttp.ClientTimeout(total=None)
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def get(
        self, url: str, timeout_s: float, headers: Mapping[str, str] | None = None
    ) -> tuple[int, Any]:
        """GET a JSON endpoint: (status, parsed body, or None when it is not JSON or is over
        SMALL_BODY bytes). The timeout bounds the whole exchange, body included."""
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with self.session.get(
            url, timeout=timeout, headers=headers, ssl=self._ssl(url), allow_redirects=False
        ) as resp:
            if resp.status != 200:
                return resp.status, None
            try:
                return resp.status, loads(await read_body(resp, SMALL_BODY, url), url)
            except ValueError:  # TooLarge, Malformed
                return resp.status, None

    async def post_json(
        self,
        url: str,
        body: dict[str, Any],
        headers: Mapping[str, str] | None = None,
        limit: int = DEFAULT_CEILING,
    ) -> dict[str, Any]:
        """POST a JSON body and read a JSON object of at most `limit` bytes back (embeddings);
        ModelError on >= 400, BadReply on an answer that is too large or not a JSON object."""
        async with self.session.post(
            url, json=body, headers=headers, ssl=self._ssl(url), allow_redirects=False
        ) as resp:
            _refuse_redirect(resp)
            if resp.status >= 400:
                text = (await resp.content.read(2000)).decode("utf-8", "replace")
                raise ModelError(
                    f"model server answered {resp.status}",
                    status_code=resp.status,
                    details={"body": text},
                )
            try:
                data = loads(await read_body(resp, limit, "the answer"), "the answer")
            except TooLarge as err:
                raise ReplyTooLarge(str(err), details={"limit": limit}) from None
            except Malformed as err:
                raise BadReply(str(err)) from None
        if not isinstance(data, dict):
            raise BadReply("the model server's answer is not a JSON object")
        return data

    async def complete(
        self,
        url: str,
        body: dict[str, Any],
        headers: Mapping[str, str] | None = None,
        on_delta: OnDelta | None = None,
        on_chunk: OnChunk | None = None,
        limit: int | None = None,
    ) -> Completion:
        """POST a chat completion and read its reply, of at most `limit` bytes (default:
        `reply_cap(body)`); BadReply when the reply breaks a bound or is not JSON."""
        cap = reply_cap(body) if limit is None else limit
        try:
            resp = await self.session.post(
                url, json=body, headers=headers, ssl=self._ssl(url), allow_redirects=False
            )
        except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError):
            # A pooled keep-alive connection the server had already closed (cpp-httplib ends
            # one after a few requests): the request never ran, so send it once more.
            resp = await self.session.post(
                url, json=body, headers=headers, ssl=self._ssl(url), allow_redirects=False
            )
        try:
            _refuse_redirect(resp)
            if resp.status >= 400:
                text = (await resp.content.read(2000)).decode("utf-8", "replace")
                raise ModelError(
                    f"model server answered {resp.status}",
                    status_code=resp.status,
                    details={"body": text},
                )
            try:
                if body.get("stream"):
                    result = await _read_stream(resp, cap, on_delta, on_chunk)
                else:
                    result = _read_whole(loads(await read_body(resp, cap, "the reply")))
            except (TooLarge, LineTooLong) as err:
                raise ReplyTooLarge(_too_large(err, cap, body), details={"limit": cap}) from None
            except Malformed as err:
                raise BadReply(str(err)) from None
            result.remote = result.remote or _remote(resp.headers)
        except BaseException:
            _reset(resp)  # drop the connection: the server stops generating
            raise
        resp.release()
        return result


def _origin(url: str) -> str:
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}".lower()


def _refuse_redirect(resp: aiohttp.ClientResponse) -> None:
    """A member's redirect is not followed: it would send the request (the prompt, the
    member's own headers on the same host) wherever the member says, another local port
    included. BadReply, the member's fault."""
    if 300 <= resp.status < 400:
        where = resp.headers.get("Location", "")[:200]
        raise BadReply(
            f"the model server answered {resp.status}, a redirect to {where!r}: "
            "not followed (set the member's url to where it serves)"
        )


def _line_limit(cap: int) -> int:
    return max(_MIN_LINE, min(cap, MAX_LINE))


def _too_large(err: Exception, cap: int, body: Mapping[str, Any]) -> str:
    if isinstance(err, TooLarge):
        what = str(err)
    else:
        what = f"a line of the stream is over its limit of {_line_limit(cap)} bytes"
    asked = body.get("max_completion_tokens") or body.get("max_tokens")
    return (
        f"{what} (max_tokens {asked} × {REPLY_TOKEN_BYTES} + {REPLY_OVERHEAD} bytes, "
        "at most the member's max_reply_mb)"
    )


def _reset(resp: aiohttp.ClientResponse) -> None:
    """Close with an RST (SO_LINGER 0) so the server's next write fails at once."""
    conn = resp.connection
    sock = conn.transport.get_extra_info("socket") if conn and conn.transport else None
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    resp.close()


def _read_whole(data: Any) -> Completion:
    """A non-streamed reply; a field of the wrong type is a BadReply, never a TypeError."""
    result = Completion()
    if not isinstance(data, dict):
        raise BadReply("the reply is not a JSON object")
    choices = data.get("choices") or [{}]
    first = choices[0] if isinstance(choices, list) else None
    message = first.get("message") or {} if isinstance(first, dict) else None
    if not isinstance(first, dict) or not isinstance(message, dict):
        raise BadReply("the reply's choices[0].message is not an object")
    content = message.get("content")
    result.text = content if isinstance(content, str) else ""
    finish = first.get("finish_reason")
    result.finish_reason = finish if isinstance(finish, str) else None
    result.usage = parse_usage(data.get("usage"))
    timings = data.get("timings")
    result.timings = timings if isinstance(timings, dict) else {}
    model = data.get("model")
    result.model = model if isinstance(model, str) else None
    calls = message.get("tool_calls")
    result.tool_calls = [c for c in calls if isinstance(c, dict)] if isinstance(calls, list) else []
    result.whole = data
    return result


def _remote(headers: Mapping[str, str]) -> dict[str, int] | None:
    """A tally gateway's witness of this call: its reply entry's seq and checkpoint size."""
    return _remote_of(
        {"seq": headers.get(REMOTE_SEQ), "checkpoint": headers.get(REMOTE_CHECKPOINT)}
    )


def _remote_of(raw: Any) -> dict[str, int] | None:
    if not isinstance(raw, dict):
        return None
    out: dict[str, int] = {}
    for key in ("seq", "checkpoint"):
        value = raw.get(key)
        if isinstance(value, str) and value.isdigit() and len(value) < 16:
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**53:
            return None
        out[key] = value
    return out


def _merge_tool_calls(calls: list[dict[str, Any]], deltas: Any) -> int:
    """Streamed tool calls arrive in pieces keyed by index; the arguments are concatenated.
    Returns the bytes (characters) of text kept."""
    kept = 0
    for delta in deltas if isinstance(deltas, list) else ():
        if not isinstance(delta, dict):
            continue
        index = delta.get("index")
        index = index if isinstance(index, int) and 0 <= index < MAX_TOOL_CALLS else len(calls)
        if index >= MAX_TOOL_CALLS:  # a delta with no index is a new call: no end to them
            raise BadReply(f"the streamed reply has more than {MAX_TOOL_CALLS} tool calls")
        while len(calls) <= index:
            calls.append({"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
            kept += _CALL_BYTES
        call = calls[index]
        if isinstance(delta.get("id"), str):
            call["id"] = delta["id"]
            kept += len(delta["id"])
        if isinstance(delta.get("type"), str):
            call["type"] = delta["type"]
            kept += len(delta["type"])
        function = delta.get("function")
        if isinstance(function, dict):
            for key in ("name", "arguments"):
                if isinstance(function.get(key), str):
                    call["function"][key] += function[key]
                    kept += len(function[key])
    return kept


async def _read_stream(
    resp: aiohttp.ClientResponse,
    cap: int,
    on_delta: OnDelta | None,
    on_chunk: OnChunk | None = None,
) -> Completion:
    """Read SSE to [DONE]; the text and tool-call fragments kept count against `cap`."""
    result = Completion()
    parts: list[str] = []
    kept = 0
    read = 0  # every line's bytes and a cost per line: what the stream made this loop do
    done = False
    max_line = _line_limit(cap)
    while True:
        raw = await resp.content.readline(max_line_length=max_line)
        if not raw:
            break
        read += len(raw) + _LINE_COST
        if read > cap:  # chunks of junk fields or empty deltas, blank lines: relayed, not kept
            raise TooLarge("the streamed reply", cap)
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            done = True
            # the end of the body, read (bounded) so the connection can be reused; past
            # the bound the connection is closed on release instead
            with contextlib.suppress(TooLarge):
                await read_body(resp, 4096, "the end of the stream")
            break
        chunk = loads(payload, "a stream chunk")
        if not isinstance(chunk, dict):
            raise BadReply("a stream chunk is not a JSON object")
        if chunk.get("error") is not None:  # a server that failed mid-stream says so in-band
            raise ModelError(
                "the model server failed mid-stream", status_code=502, details={"body": chunk}
            )
        if chunk.get("usage"):
            result.usage = parse_usage(chunk["usage"])
        if isinstance(chunk.get("timings"), dict) and chunk["timings"]:
            result.timings = chunk["timings"]
        if chunk.get("tally") is not None:
            result.remote = _remote_of(chunk["tally"])
        if isinstance(chunk.get("model"), str) and chunk["model"]:
            result.model = chunk["model"]
        if result.id is None and isinstance(chunk.get("id"), str):
            result.id = chunk["id"]
        if result.created is None and isinstance(chunk.get("created"), int):
            result.created = chunk["created"]
        choices = chunk.get("choices") or ()
        for choice in choices if isinstance(choices, list) else ():
            if not isinstance(choice, dict):
                continue
            step = choice.get("delta") or {}
            step = step if isinstance(step, dict) else {}
            kept += _merge_tool_calls(result.tool_calls, step.get("tool_calls"))
            delta = step.get("content")
            if isinstance(delta, str) and delta:
                kept += len(delta)
                if kept > cap:
                    raise TooLarge("the streamed reply", cap)
                parts.append(delta)
                if on_delta is not None:
                    echoed = on_delta(delta)
                    if inspect.isawaitable(echoed):
                        await echoed
            if isinstance(choice.get("finish_reason"), str):
                result.finish_reason = choice["finish_reason"]
        if kept > cap:
            raise TooLarge("the streamed reply", cap)
        # relayed once counted: a chunk that crosses the cap never reaches the caller's client
        if on_chunk is not None:
            try:
                relayed = on_chunk(chunk)
                if inspect.isawaitable(relayed):
                    await relayed
            except (ConnectionError, aiohttp.ClientError) as err:
                raise ConsumerGone(str(err)) from err
    if not done and result.finish_reason is None:
        # The body ended before the stream did: the same as a connection lost mid-stream (the
        # lease turns it into SlotLost), not a short success. A finish_reason without [DONE]
        # is accepted: the reply itself is complete.
        raise aiohttp.ClientPayloadError("the stream ended without [DONE] or a finish_reason")
    result.text = "".join(parts)
    return result
