"""A fake OpenAI-compatible llama-server for tests, in-process or as a subprocess.

    python -m tests.slots.fake_server --port {port} --slots {slots} [--load-delay 0.3] ...

It speaks the parts of llama-server the pool uses: /health (503 while "loading"), /props,
/slots (is_processing), /v1/models, /v1/chat/completions (non-stream and SSE with [DONE],
usage with cached_tokens, timings, id_slot queueing). Faults are injected with flags or at run
time through POST /_fault {"mode": "crash" | "hang" | "fail", "count": N}: "crash" exits the
process (in-process: drops the connection) mid-stream, "truncate" ends the next stream cleanly
after N tokens (`after`) with neither a finish_reason nor [DONE], "hang" stops answering anything,
"fail" answers the next N chat requests with 500 (or `status`), "die" makes the next chat request
the last one answered: it is cut mid-body (`how` "cut") or answered 502 (`how` "502"), and from
then on every request gets 502, as from a proxy whose backend is gone. Hostile replies, for
the next `count` chat requests: "huge" answers `bytes` of valid JSON (made as it is sent, never
held) with an honest Content-Length, or chunked with `chunked`; "flood" streams `bytes` of
text in 64 KiB deltas; "deep" answers JSON nested `depth` levels; "drip" streams one token
every `interval` seconds and never ends; "wide" answers `bytes` of `[[],[],...]` (small in
bytes, huge parsed); "calls" streams tool-call deltas with no index, `per` to a chunk, for
ever (each opens a new call); "redirect" answers 307 to `to`; "junk" streams chunks with an
empty delta and a `bytes`-long junk field for ever (`bytes` 0: blank lines); with
`stream_only` only streamed requests count, with `embeddings` embeddings requests (instead of
chat requests).
`--ready-file PATH`
keeps it "loading" until PATH exists (a spawned server a test can fix from outside).
`--models a,b` sets what /v1/models lists; `--ollama` answers as Ollama does (/api/version;
no /health, /props, /slots).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
from typing import Any

from aiohttp import web


class FakeServer:
    def __init__(
        self,
        *,
        slots: int = 2,
        n_ctx: int = 2048,
        load_delay_s: float = 0.0,
        token_delay_s: float = 0.0,
        subprocess_mode: bool = False,
        ready_file: str | None = None,
        models: list[str] | None = None,
        ollama: bool = False,
    ) -> None:
        self.slots = slots
        self.n_ctx = n_ctx
        self.token_delay_s = token_delay_s
        self.subprocess_mode = subprocess_mode
        self.ready_at = time.monotonic() + load_delay_s
        self.ready_file = ready_file
        self.model_ids = models or ["fake"]
        self.hang = False
        self.embeddings_off = False
        """Answer /v1/embeddings as llama-server does when started without --embeddings."""
        self.health_status: int | None = None  # answer /health with this status instead
        self.crash_after: int | None = None  # tokens streamed before the crash
        self.truncate_after: int | None = None  # tokens streamed before a clean, early end
        self.fail_next = 0
        self.fail_status = 500
        self.dying: str | None = None  # "cut" or "502": how the next chat request ends it
        self.hostile: dict[str, Any] | None = None  # the hostile reply mode (see /_fault)
        self.hostile_left = 0
        self.dead = False
        self.requests: list[dict[str, Any]] = []
        self.processing: set[int] = set()
        self.max_concurrent = 0
        self._locks = [asyncio.Lock() for _ in range(slots)]
        self._last_prompt: dict[int, list[str]] = {}
        self._runner: web.AppRunner | None = None
        self.port = 0
        self.app = web.Application()
        if ollama:  # Ollama's shape: the OpenAI API and /api/*, no llama.cpp endpoints
            self.app.router.add_get("/api/version", self.version)
        else:
            self.app.router.add_get("/health", self.health)
            self.app.router.add_get("/v1/health", self.health)
            self.app.router.add_get("/props", self.props)
            self.app.router.add_get("/slots", self.slots_view)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_post("/v1/chat/completions", self.chat)
        self.app.router.add_post("/v1/embeddings", self.embeddings)
        self.app.router.add_post("/_fault", self.fault)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self, port: int = 0) -> str:
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port)
        await site.start()
        server = site._server
        assert server is not None
        self.port = server.sockets[0].getsockname()[1]  # type: ignore[attr-defined]
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def loading(self) -> bool:
        if self.ready_file is not None and not os.path.exists(self.ready_file):
            return True
        return time.monotonic() < self.ready_at

    async def _gate(self) -> None:
        while self.hang:
            await asyncio.sleep(3600)

    async def health(self, request: web.Request) -> web.Response:
        await self._gate()
        if self.dead:
            return web.json_response({"error": {"code": 502}}, status=502)
        if self.health_status is not None:
            return web.json_response(
                {"error": {"code": self.health_status}}, status=self.health_status
            )
        if self.loading():
            return web.json_response(
                {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}},
                status=503,
            )
        return web.json_response({"status": "ok"})

    async def props(self, request: web.Request) -> web.Response:
        await self._gate()
        if self.loading():
            return web.json_response({"error": {"code": 503}}, status=503)
        return web.json_response(
            {
                "total_slots": self.slots,
                "default_generation_settings": {"n_ctx": self.n_ctx},
                "model_path": "fake.gguf",
            }
        )

    async def slots_view(self, request: web.Request) -> web.Response:
        await self._gate()
        return web.json_response(
            [
                {"id": i, "n_ctx": self.n_ctx, "is_processing": i in self.processing}
                for i in range(self.slots)
            ]
        )

    async def models(self, request: web.Request) -> web.Response:
        await self._gate()
        data = [{"id": name, "object": "model"} for name in self.model_ids]
        return web.json_response({"object": "list", "data": data})

    async def version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": "0.0.0-fake"})

    async def fault(self, request: web.Request) -> web.Response:
        body = await request.json()
        mode = body.get("mode")
        if mode == "hang":
            self.hang = True
        elif mode == "crash":
            self.crash_after = int(body.get("after", 0))
        elif mode == "truncate":
            self.truncate_after = int(body.get("after", 0))
        elif mode == "fail":
            self.fail_next = int(body.get("count", 1))
            self.fail_status = int(body.get("status", 500))
        elif mode == "die":
            self.dying = str(body.get("how", "cut"))
        elif mode in ("huge", "flood", "deep", "drip", "wide", "calls", "redirect", "junk"):
            self.hostile = body
            self.hostile_left = int(body.get("count", 1))
        elif mode == "exit":
            asyncio.get_running_loop().call_later(0.01, os._exit, int(body.get("code", 3)))
        return web.json_response({"ok": True})

    def _pick_slot(self, wanted: int | None) -> int:
        if wanted is not None and 0 <= wanted < self.slots:
            return wanted
        for i in range(self.slots):
            if not self._locks[i].locked():
                return i
        return 0

    async def embeddings(self, request: web.Request) -> web.StreamResponse:
        """One short vector per input, derived from its text (no model: a fixed shape)."""
        body = await request.json()
        self.requests.append(body)
        if self.embeddings_off:
            error = {
                "code": 501,
                "message": "This server does not support embeddings. Start it with `--embeddings`",
                "type": "not_supported_error",
            }
            return web.json_response({"error": error}, status=501)
        if self.hostile is not None and self.hostile_left > 0 and self.hostile.get("embeddings"):
            self.hostile_left -= 1
            return await self._hostile(request, self.hostile)
        inputs = body["input"] if isinstance(body["input"], list) else [body["input"]]
        data = [
            {"object": "embedding", "index": i, "embedding": [len(str(x)) / 10, 0.5, -0.25]}
            for i, x in enumerate(inputs)
        ]
        tokens = sum(len(str(x).split()) for x in inputs)
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        return web.json_response(
            {"object": "list", "data": data, "model": body.get("model"), "usage": usage}
        )

    async def chat(self, request: web.Request) -> web.StreamResponse:
        await self._gate()
        body = await request.json()
        self.requests.append(body)
        if self.dying is not None:
            how, self.dying, self.dead = self.dying, None, True
            if how == "cut":
                await self._cut(request, bool(body.get("stream")))
        if self.dead:
            return web.json_response({"error": {"code": 502, "message": "Bad Gateway"}}, status=502)
        if self.fail_next > 0:
            self.fail_next -= 1
            status = self.fail_status
            return web.json_response(
                {"error": {"code": status, "message": "injected"}}, status=status
            )
        hostile = self.hostile or {}
        streams = bool(body.get("stream")) or not hostile.get("stream_only")
        if (
            self.hostile is not None
            and self.hostile_left > 0
            and streams
            and not hostile.get("embeddings")
        ):
            self.hostile_left -= 1
            return await self._hostile(request, self.hostile)
        id_slot = body.get("id_slot")
        slot = self._pick_slot(id_slot if isinstance(id_slot, int) and id_slot >= 0 else None)
        async with self._locks[slot]:
            self.processing.add(slot)
            self.max_concurrent = max(self.max_concurrent, len(self.processing))
            try:
                return await self._generate(request, body, slot)
            finally:
                self.processing.discard(slot)

    async def _hostile(self, request: web.Request, mode: dict[str, Any]) -> web.StreamResponse:
        """One hostile reply (see the module docstring); a client that leaves ends it."""
        kind = mode["mode"]
        piece = b"a" * 65536
        if kind == "deep":
            n = int(mode.get("depth", 100_000))
            return web.Response(body=b"[" * n + b"]" * n, content_type="application/json")
        if kind == "redirect":
            raise web.HTTPTemporaryRedirect(str(mode["to"]))
        if kind == "wide":
            n = int(mode["bytes"]) // 3
            return web.Response(body=b"[" + b"[]," * n + b"[]]", content_type="application/json")
        if kind == "junk":
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            size = int(mode.get("bytes", 0))
            junk = {"choices": [{"index": 0, "delta": {}}], "junk": "j" * size}
            frame = f"data: {json.dumps(junk)}\n\n".encode() if size else b"\n" * 4096
            while True:
                await resp.write(frame)
                await asyncio.sleep(0)
        if kind == "calls":
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            empty = ",".join(["{}"] * int(mode.get("per", 1000)))
            line = f'data: {{"choices":[{{"index":0,"delta":{{"tool_calls":[{empty}]}}}}]}}\n\n'
            while True:
                await resp.write(line.encode())
                await asyncio.sleep(0)
        if kind in ("flood", "drip"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            left = int(mode.get("bytes", 0))
            while kind == "drip" or left > 0:
                text = "t " if kind == "drip" else piece.decode()
                chunk = {"choices": [{"index": 0, "delta": {"content": text}}]}
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
                left -= len(text)
                await asyncio.sleep(float(mode.get("interval", 0)))
            await resp.write(b"data: [DONE]\n\n")
            return resp
        total = int(mode["bytes"])
        head = b'{"object":"chat.completion","choices":[{"index":0,"finish_reason":"stop",'
        head += b'"message":{"role":"assistant","content":"'
        tail = b'"}}]}'
        headers = {"Content-Type": "application/json"}
        if not mode.get("chunked"):
            headers["Content-Length"] = str(total)
        resp = web.StreamResponse(headers=headers)
        await resp.prepare(request)
        await resp.write(head)
        left = total - len(head) - len(tail)
        while left > 0:
            await resp.write(piece[: min(left, len(piece))])
            left -= len(piece)
        await resp.write(tail)
        return resp

    async def _cut(self, request: web.Request, stream: bool) -> None:
        """Start an answer and close the connection half-way through its body."""
        kind = "text/event-stream" if stream else "application/json"
        resp = web.StreamResponse(headers={"Content-Type": kind, "Content-Length": "4096"})
        await resp.prepare(request)
        await resp.write(
            b'data: {"object": "chat.completion.chunk", "choi'
            if stream
            else b'{"id": "chatcmpl-fake", "choi'
        )
        assert request.transport is not None
        request.transport.close()
        raise ConnectionResetError("injected death")

    async def _generate(
        self, request: web.Request, body: dict[str, Any], slot: int
    ) -> web.StreamResponse:
        words = " ".join(str(m.get("content", "")) for m in body.get("messages", [])).split()
        previous = self._last_prompt.get(slot, [])
        cached = 0
        for a, b in zip(previous, words, strict=False):
            if a != b:
                break
            cached += 1
        self._last_prompt[slot] = words
        n = int(body.get("max_tokens") or 16)
        if body.get("response_format"):
            tokens = ['{"ok": ', "true}"]
        else:
            tokens = [f"t{i} " for i in range(n)]
        usage = {
            "prompt_tokens": len(words),
            "completion_tokens": len(tokens),
            "total_tokens": len(words) + len(tokens),
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        timings = {"cache_n": cached, "prompt_n": len(words) - cached, "predicted_n": len(tokens)}
        finish = "length" if not body.get("response_format") else "stop"
        if not body.get("stream"):
            for i in range(len(tokens)):
                await self._tick(i)
            return web.json_response(
                {
                    "id": "chatcmpl-fake",
                    "object": "chat.completion",
                    "model": body.get("model"),
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": "".join(tokens)},
                            "finish_reason": finish,
                        }
                    ],
                    "usage": usage,
                    "timings": timings,
                    "id_slot": slot,
                }
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i, token in enumerate(tokens):
            if self.truncate_after is not None and i >= self.truncate_after:
                self.truncate_after = None
                await resp.write_eof()  # a well-formed end of the body, but not of the stream
                return resp
            await self._tick(i, request)
            chunk = {
                "object": "chat.completion.chunk",
                "model": body.get("model"),
                "choices": [{"index": 0, "delta": {"content": token}, "finish_reason": None}],
            }
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        final = {
            "object": "chat.completion.chunk",
            "choices": [{"index": 0, "delta": {}, "finish_reason": finish}],
        }
        await resp.write(f"data: {json.dumps(final)}\n\n".encode())
        tail = {
            "object": "chat.completion.chunk",
            "choices": [],
            "usage": usage,
            "timings": timings,
        }
        await resp.write(f"data: {json.dumps(tail)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _tick(self, i: int, request: web.Request | None = None) -> None:
        if self.crash_after is not None and i >= self.crash_after:
            if self.subprocess_mode:
                os._exit(7)
            self.crash_after = None
            if request is not None and request.transport is not None:
                request.transport.close()
            raise ConnectionResetError("injected crash")
        await self._gate()
        if self.token_delay_s:
            await asyncio.sleep(self.token_delay_s)


async def _serve(args: argparse.Namespace) -> None:
    if args.die_on_start:
        print("fake server: refusing to start", flush=True)
        sys.exit(5)
    server = FakeServer(
        slots=args.slots,
        n_ctx=args.ctx // max(1, args.slots),
        load_delay_s=args.load_delay,
        token_delay_s=args.token_delay,
        subprocess_mode=True,
        ready_file=args.ready_file,
        models=args.models.split(",") if args.models else None,
        ollama=args.ollama,
    )
    if args.hang:
        server.hang = True
    await server.start(args.port)
    print(f"fake server listening on {server.url}", flush=True)
    await asyncio.Event().wait()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--slots", type=int, default=2)
    parser.add_argument("--ctx", type=int, default=4096)
    parser.add_argument("--load-delay", type=float, default=0.0)
    parser.add_argument("--token-delay", type=float, default=0.0)
    parser.add_argument("--hang", action="store_true")
    parser.add_argument("--die-on-start", action="store_true")
    parser.add_argument("--ready-file", default=None)
    parser.add_argument("--ollama", action="store_true")
    parser.add_argument("--models", default=None, help="comma-separated /v1/models ids")
    args = parser.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(args))


if __name__ == "__main__":
    main()
