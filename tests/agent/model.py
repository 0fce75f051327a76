"""A scripted model that calls tools, on top of the pool's fake llama-server.

`ToolServer` answers each chat request with the next step of its script. A step is a tool
call (`Step(tool, arguments)`), said the way the request asks: as OpenAI `tool_calls` when
the request carries `tools` (native mode), as the JSON text `{"tool", "arguments"}` when it
carries a `response_format` (json mode); or a raw text (`Raw`), said as the reply's content
in either mode (a malformed call, prose around a call). Past the end of the script it repeats
its last step. Usage counts words; cached tokens are the words shared with the slot's
previous prompt, as llama.cpp's prompt cache would reuse them. `stream` requests are answered
with SSE chunks, tool calls split across chunks as llama.cpp streams them.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from tests.slots.fake_server import FakeServer


@dataclass(frozen=True)
class Step:
    tool: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Raw:
    text: str


Script = list[Step | Raw]


class ToolServer(FakeServer):
    def __init__(self, script: Script, *, n_ctx: int = 8192, props: dict[str, Any] | None = None):
        super().__init__(slots=2, n_ctx=n_ctx)
        self.script = list(script)
        self.served = 0
        self.extra_props = props or {}
        self.refuse_tools = False
        """Answer a request with `tools` 400, as llama-server does without --jinja."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def chats(self) -> list[dict[str, Any]]:
        return [r for r in self.requests if "messages" in r]

    async def props(self, request: web.Request) -> web.Response:
        base = {"total_slots": self.slots, "default_generation_settings": {"n_ctx": self.n_ctx}}
        return web.json_response(base | self.extra_props)

    def _next(self) -> Step | Raw:
        step = self.script[min(self.served, len(self.script) - 1)]
        self.served += 1
        return step

    async def _generate(
        self, request: web.Request, body: dict[str, Any], slot: int
    ) -> web.StreamResponse:
        if body.get("tools") and self.refuse_tools:
            self.requests.remove(body)
            return web.json_response(
                {"error": {"code": 400, "message": "tools param requires --jinja flag"}},
                status=400,
            )
        step = self._next()
        message: dict[str, Any] = {"role": "assistant", "content": ""}
        if isinstance(step, Raw):
            message["content"] = step.text
        elif body.get("tools"):
            arguments = json.dumps(step.arguments)
            call = {"id": f"c{self.served}", "type": "function"}
            message["tool_calls"] = [
                call | {"function": {"name": step.tool, "arguments": arguments}}
            ]
            message["content"] = None
        else:
            message["content"] = json.dumps({"tool": step.tool, "arguments": step.arguments})
        words = json.dumps(body.get("messages", [])).split()
        previous = self._last_prompt.get(slot, [])
        cached = 0
        for a, b in zip(previous, words, strict=False):
            if a != b:
                break
            cached += 1
        self._last_prompt[slot] = words
        completion = len(json.dumps(message).split())
        usage = {
            "prompt_tokens": len(words),
            "completion_tokens": completion,
            "total_tokens": len(words) + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        timings = {"cache_n": cached, "prompt_n": len(words) - cached, "prompt_ms": 1.5}
        finish = "tool_calls" if message.get("tool_calls") else "stop"
        if not body.get("stream"):
            return web.json_response(
                {
                    "id": "chatcmpl-tools",
                    "object": "chat.completion",
                    "created": int(time.time()),
                    "model": body.get("model"),
                    "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                    "usage": usage,
                    "timings": timings,
                }
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        deltas: list[dict[str, Any]] = []
        if message.get("content"):
            text = message["content"]
            deltas += [{"content": text[i : i + 7]} for i in range(0, len(text), 7)]
        for call in message.get("tool_calls") or ():
            head = {"index": 0, "id": call["id"], "type": "function"}
            deltas.append({"tool_calls": [head | {"function": {"name": call["function"]["name"]}}]})
            args = call["function"]["arguments"]
            for i in range(0, len(args), 5):
                piece = {"index": 0, "function": {"arguments": args[i : i + 5]}}
                deltas.append({"tool_calls": [piece]})
        for delta in deltas:
            chunk = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": delta}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        end = {"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]}
        tail = {"choices": [], "usage": usage, "timings": timings}
        await resp.write(f"data: {json.dumps(end)}\n\ndata: {json.dumps(tail)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp
