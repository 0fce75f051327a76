"""A minimal scripted OpenAI-compatible model server: replies chosen by the prompt's content.

Rules are (substring, reply, delay_s): the first rule whose substring is in the last user
message answers. It counts requests and notices aborted ones (client went away).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from aiohttp import web


class ScriptedServer:
    def __init__(self, rules: list[tuple[str, str, float]], default: str = "ok") -> None:
        self.rules = rules
        self.default = default
        self.requests: list[dict[str, Any]] = []
        self.aborted = 0
        self.closing = False
        self._runner: web.AppRunner | None = None
        self.port = 0
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/health", self._health)
        app.router.add_get("/props", self._props)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._chat)
        self.app = app

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def start(self) -> str:
        self._runner = web.AppRunner(self.app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        server = site._server
        assert server is not None
        self.port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
        return self.url

    async def stop(self) -> None:
        self.closing = True
        if self._runner is not None:
            await self._runner.cleanup()

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _props(self, request: web.Request) -> web.Response:
        return web.json_response({"total_slots": 4, "default_generation_settings": {"n_ctx": 4096}})

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "scripted"}]})

    def _reply(self, body: dict[str, Any]) -> tuple[str, float]:
        users = [m for m in body.get("messages", []) if m.get("role") == "user"]
        text = str(users[-1].get("content", "")) if users else ""
        system = str(body["messages"][0].get("content", "")) if body.get("messages") else ""
        for needle, reply, delay in self.rules:
            if needle in text or needle in system:
                return reply, delay
        return self.default, 0.0

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        reply, delay = self._reply(body)
        deadline = time.monotonic() + delay
        try:
            while time.monotonic() < deadline and not self.closing:
                await asyncio.sleep(0.02)
        except asyncio.CancelledError:
            self.aborted += 1
            raise
        usage = {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
        timings = {"prompt_ms": 1.25, "predicted_ms": 2.5}
        if not body.get("stream"):
            return web.json_response(
                {
                    "id": "x",
                    "object": "chat.completion",
                    "created": int(time.time()),
                    "model": "scripted",
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": reply},
                            "finish_reason": "stop",
                        }
                    ],
                    "usage": usage,
                    "timings": timings,
                }
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for word in reply.split(" "):
            chunk = {"choices": [{"index": 0, "delta": {"content": word + " "}}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        final = {
            "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
            "usage": usage,
            "timings": timings,
        }
        await resp.write(f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n".encode())
        await resp.write_eof()
        return resp


def roster_toml(url: str) -> str:
    lanes = "\n".join(
        f'[[lanes]]\nname = "{name}"\nkeywords = ["{name}"]\ntier = "cheap"\n'
        f'system = "You do {name} work."\n'
        for name in ("backend", "docs", "testing")
    )
    return f"""version = 1
[policy]
max_parallel = 4

[[models]]
name = "tiny"
url = "{url}"

[[models]]
name = "big"
url = "{url}"

[tiers]
ladder = ["cheap", "capable"]
cheap = ["tiny"]
capable = ["big"]

{lanes}"""
