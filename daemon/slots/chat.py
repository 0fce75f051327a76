"""OpenAI-compatible `/v1/chat/completions` over one shared aiohttp session.

Streaming reads Server-Sent Events up to `data: [DONE]`, asking for the final usage chunk; a
stream that ends with neither [DONE] nor a finish_reason was cut short and is an error.
Any exception while a request is open (including cancellation) closes its connection rather
than returning it to the pool, so llama-server notices and stops generating.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import socket
import struct
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp

from daemon.slots.errors import ConsumerGone, ModelError
from daemon.slots.records import Usage
from roster import Member

OnDelta = Callable[[str], object]
OnChunk = Callable[[dict[str, Any]], object]
"""Called with each streamed chunk as parsed (a gateway relays them to its own client)."""

REMOTE_SEQ = "X-Tally-Seq"
REMOTE_CHECKPOINT = "X-Tally-Checkpoint"


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


def parse_usage(raw: Any) -> Usage:
    if not isinstance(raw, dict):
        return Usage()
    details = raw.get("prompt_tokens_details") or {}
    return Usage(
        prompt_tokens=int(raw.get("prompt_tokens") or 0),
        completion_tokens=int(raw.get("completion_tokens") or 0),
        cached_tokens=int(details.get("cached_tokens") or 0) if isinstance(details, dict) else 0,
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
        """GET a JSON endpoint: (status, parsed body or None)."""
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with self.session.get(url, timeout=timeout, headers=headers) as resp:
            if resp.status != 200:
                return resp.status, None
            try:
                return resp.status, await resp.json(content_type=None)
            except ValueError:
                return resp.status, None

    async def post_json(
        self, url: str, body: dict[str, Any], headers: Mapping[str, str] | None = None
    ) -> dict[str, Any]:
        """POST a JSON body and read a JSON object back (embeddings); ModelError on >= 400."""
        async with self.session.post(url, json=body, headers=headers) as resp:
            if resp.status >= 400:
                text = (await resp.content.read(2000)).decode("utf-8", "replace")
                raise ModelError(
                    f"model server answered {resp.status}",
                    status_code=resp.status,
                    details={"body": text},
                )
            data = await resp.json(content_type=None)
        if not isinstance(data, dict):
            raise ModelError("the model server's answer is not a JSON object", status_code=502)
        return data

    async def complete(
        self,
        url: str,
        body: dict[str, Any],
        headers: Mapping[str, str] | None = None,
        on_delta: OnDelta | None = None,
        on_chunk: OnChunk | None = None,
    ) -> Completion:
        try:
            resp = await self.session.post(url, json=body, headers=headers)
        except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError):
            # A pooled keep-alive connection the server had already closed (cpp-httplib ends
            # one after a few requests): the request never ran, so send it once more.
            resp = await self.session.post(url, json=body, headers=headers)
        try:
            if resp.status >= 400:
                text = (await resp.content.read(2000)).decode("utf-8", "replace")
                raise ModelError(
                    f"model server answered {resp.status}",
                    status_code=resp.status,
                    details={"body": text},
                )
            if body.get("stream"):
                result = await _read_stream(resp, on_delta, on_chunk)
            else:
                result = _read_whole(await resp.json(content_type=None))
            result.remote = result.remote or _remote(resp.headers)
        except BaseException:
            _reset(resp)  # drop the connection: the server stops generating
            raise
        resp.release()
        return result


def _reset(resp: aiohttp.ClientResponse) -> None:
    """Close with an RST (SO_LINGER 0) so the server's next write fails at once."""
    conn = resp.connection
    sock = conn.transport.get_extra_info("socket") if conn and conn.transport else None
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    resp.close()


def _read_whole(data: Any) -> Completion:
    result = Completion()
    if not isinstance(data, dict):
        return result
    choices = data.get("choices") or [{}]
    message = choices[0].get("message") or {}
    result.text = message.get("content") or ""
    result.finish_reason = choices[0].get("finish_reason")
    result.usage = parse_usage(data.get("usage"))
    result.timings = data.get("timings") or {}
    result.model = data.get("model")
    result.tool_calls = list(message.get("tool_calls") or [])
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


def _merge_tool_calls(calls: list[dict[str, Any]], deltas: Any) -> None:
    """Streamed tool calls arrive in pieces keyed by index; the arguments are concatenated."""
    for delta in deltas if isinstance(deltas, list) else ():
        if not isinstance(delta, dict):
            continue
        index = delta.get("index")
        index = index if isinstance(index, int) and 0 <= index < 128 else len(calls)
        while len(calls) <= index:
            calls.append({"id": "", "type": "function", "function": {"name": "", "arguments": ""}})
        call = calls[index]
        if isinstance(delta.get("id"), str):
            call["id"] = delta["id"]
        if isinstance(delta.get("type"), str):
            call["type"] = delta["type"]
        function = delta.get("function")
        if isinstance(function, dict):
            for key in ("name", "arguments"):
                if isinstance(function.get(key), str):
                    call["function"][key] += function[key]


async def _read_stream(
    resp: aiohttp.ClientResponse, on_delta: OnDelta | None, on_chunk: OnChunk | None = None
) -> Completion:
    result = Completion()
    parts: list[str] = []
    done = False
    async for raw in resp.content:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue
        payload = line[5:].strip()
        if payload == b"[DONE]":
            done = True
            await resp.read()  # consume the end of the body so the connection can be reused
            break
        chunk = json.loads(payload)
        if not isinstance(chunk, dict):
            raise aiohttp.ClientPayloadError("a stream chunk is not a JSON object")
        if chunk.get("error") is not None:  # a server that failed mid-stream says so in-band
            raise ModelError(
                "the model server failed mid-stream", status_code=502, details={"body": chunk}
            )
        if chunk.get("usage"):
            result.usage = parse_usage(chunk["usage"])
        if chunk.get("timings"):
            result.timings = chunk["timings"]
        if chunk.get("tally") is not None:
            result.remote = _remote_of(chunk["tally"])
        result.model = chunk.get("model") or result.model
        if result.id is None and isinstance(chunk.get("id"), str):
            result.id = chunk["id"]
        if result.created is None and isinstance(chunk.get("created"), int):
            result.created = chunk["created"]
        if on_chunk is not None:
            try:
                relayed = on_chunk(chunk)
                if inspect.isawaitable(relayed):
                    await relayed
            except (ConnectionError, aiohttp.ClientError) as err:
                raise ConsumerGone(str(err)) from err
        for choice in chunk.get("choices") or ():
            _merge_tool_calls(result.tool_calls, (choice.get("delta") or {}).get("tool_calls"))
            delta = (choice.get("delta") or {}).get("content")
            if delta:
                parts.append(delta)
                if on_delta is not None:
                    echoed = on_delta(delta)
                    if inspect.isawaitable(echoed):
                        await echoed
            if choice.get("finish_reason"):
                result.finish_reason = choice["finish_reason"]
    if not done and result.finish_reason is None:
        # The body ended before the stream did: the same as a connection lost mid-stream (the
        # lease turns it into SlotLost), not a short success. A finish_reason without [DONE]
        # is accepted: the reply itself is complete.
        raise aiohttp.ClientPayloadError("the stream ended without [DONE] or a finish_reason")
    result.text = "".join(parts)
    return result
