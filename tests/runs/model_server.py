"""Scripted replies on top of the slot pool's fake llama-server (`tests.slots.fake_server`).

One fake model server for the whole suite: `FakeServer` speaks llama-server (health, props,
/slots with is_processing, id_slot queueing, SSE, faults); `ScriptedServer` only changes what
a chat request answers. Rules are (substring, reply, delay_s): the first rule whose substring
is in the last user message or the system prompt answers. A reply may be a list: each match
takes the next one (the last one repeats). It counts requests and notices aborted ones — the
client closed the connection while the reply was being generated.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

from aiohttp import web

from daemon.config import Settings
from tests.slots.fake_server import FakeServer

Reply = str | list[str]


class ScriptedServer(FakeServer):
    def __init__(self, rules: list[tuple[str, Reply, float]], default: str = "ok") -> None:
        super().__init__(slots=4, n_ctx=4096)
        self.rules = rules
        self.default = default
        self.aborted = 0
        self.closing = False
        self._taken: dict[int, int] = {}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def stop(self) -> None:
        self.closing = True
        await super().stop()

    def in_flight(self) -> int:
        """Chat requests being generated right now (llama-server's busy slots)."""
        return len(self.processing)

    def _reply(self, body: dict[str, Any]) -> tuple[str, float]:
        messages = body.get("messages", [])
        users = [m for m in messages if m.get("role") == "user"]
        text = str(users[-1].get("content", "")) if users else ""
        system = str(messages[0].get("content", "")) if messages else ""
        for i, (needle, reply, delay) in enumerate(self.rules):
            if needle in text or needle in system:
                if isinstance(reply, list):
                    n = self._taken.get(i, 0)
                    self._taken[i] = n + 1
                    return reply[min(n, len(reply) - 1)], delay
                return reply, delay
        return self.default, 0.0

    async def _generate(
        self, request: web.Request, body: dict[str, Any], slot: int
    ) -> web.StreamResponse:
        reply, delay = self._reply(body)
        deadline = time.monotonic() + delay
        try:
            while time.monotonic() < deadline and not self.closing:
                await asyncio.sleep(0.02)
        except asyncio.CancelledError:  # aiohttp cancels the handler when the client leaves
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
                    "id_slot": slot,
                }
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        words = reply.split(" ")
        for i, word in enumerate(words):
            piece = word if i == len(words) - 1 else word + " "
            chunk = {"choices": [{"index": 0, "delta": {"content": piece}}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        final = {
            "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
            "usage": usage,
            "timings": timings,
        }
        await resp.write(f"data: {json.dumps(final)}\n\ndata: [DONE]\n\n".encode())
        await resp.write_eof()
        return resp


def roster_toml(url: str, sampling: str = "", lanes: str | None = None, **policy: Any) -> str:
    """The test roster: two members (tiers cheap, capable) on one model server at `url`.

    `sampling` is TOML for the first member's `sampling` table; `lanes` replaces the three
    one-keyword lanes (backend, docs, testing); `policy` adds `[policy]` keys.
    """
    if lanes is None:
        lanes = "\n".join(
            f'[[lanes]]\nname = "{name}"\nkeywords = ["{name}"]\ntier = "cheap"\n'
            f'system = "You do {name} work."\n'
            for name in ("backend", "docs", "testing")
        )
    extra = "".join(f"{key} = {json.dumps(value)}\n" for key, value in policy.items())
    return f"""version = 1
[policy]
max_parallel = 4
{extra}
[[models]]
name = "tiny"
url = "{url}"
slots = 4
sampling = {{ {sampling} }}

[[models]]
name = "big"
url = "{url}"
slots = 4

[tiers]
ladder = ["cheap", "capable"]
cheap = ["tiny"]
capable = ["big"]

{lanes}"""


def settings_for(tmp_path: Path, roster_text: str, **over: Any) -> Settings:
    """Daemon settings with everything under `tmp_path` and a short drain."""
    roster = tmp_path / "roster.toml"
    roster.write_text(roster_text)
    return Settings.from_env(
        **{
            "state_dir": tmp_path / "state",
            "runtime_dir": tmp_path / "run",
            "roster_path": roster,
            "checkpoint_interval_s": 3600,
            "drain_s": 0.2,
        }
        | over
    )
