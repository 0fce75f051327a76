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

from daemon.slots.errors import ModelError
from daemon.slots.records import Usage
from roster import Member

OnDelta = Callable[[str], object]


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
    """What came back: text, finish reason, usage, llama.cpp timings, model."""

    __slots__ = ("finish_reason", "model", "text", "timings", "usage")

    def __init__(self) -> None:
        self.text = ""
        self.finish_reason: str | None = None
        self.usage = Usage()
        self.timings: dict[str, Any] = {}
        self.model: str | None = None


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

    async def complete(
        self,
        url: str,
        body: dict[str, Any],
        headers: Mapping[str, str] | None = None,
        on_delta: OnDelta | None = None,
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
                result = await _read_stream(resp, on_delta)
            else:
                result = _read_whole(await resp.json(content_type=None))
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
    return result


async def _read_stream(resp: aiohttp.ClientResponse, on_delta: OnDelta | None) -> Completion:
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
        if chunk.get("usage"):
            result.usage = parse_usage(chunk["usage"])
        if chunk.get("timings"):
            result.timings = chunk["timings"]
        result.model = chunk.get("model") or result.model
        for choice in chunk.get("choices") or ():
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
