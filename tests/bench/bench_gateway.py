"""Gateway benchmark: what witnessing every call costs, against the same server without tally.

1. Throughput, gateway / direct, on the real embedded server (xllamacpp + SmolLM2, the
   default roster's `tiny`, 2 slots) at concurrency 1, 2 and 4: the same prompts, greedy and
   seeded, 64 tokens each; completion tokens per second; rounds interleaved, median ratio.
2. Added latency, p50, in front of a zero-latency stub (the fake llama-server in process,
   one token): gateway minus direct. Measured with the state dir on disk (two fsynced ledger
   entries per call: gateway.call before the request goes out, gateway.reply before the
   answer) and on tmpfs (the gateway's own work without the disk), next to a plain aiohttp
   reverse proxy in front of the same stub (no witnessing at all).
3. Follow-up turn with and without slot affinity on the real server: a conversation with a
   long system prompt, a second conversation in between, then the first one's next turn.
   Reported: TTFT (from gateway.reply's ttft_us) and the prompt tokens the server reused.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from tests.bench.table import print_rows

TOKEN = "bench-token"
ROUNDS = 3
REQUESTS = 6  # per concurrency slot per round
PROMPTS = [
    "Write two sentences about rivers.",
    "List three uses of copper.",
    "Describe a quiet morning in one paragraph.",
    "Explain what a compiler does.",
]


# The default roster's `tiny` sampling, sent to the server directly too, so both sides
# generate the same tokens (the gateway adds a member's sampling under the client's values).
SAMPLING = {"top_p": 0.9, "top_k": 40, "min_p": 0.05, "repeat_penalty": 1.1}


@asynccontextmanager
async def served(app: web.Application) -> AsyncIterator[str]:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


@asynccontextmanager
async def gateway_daemon(state: Path, roster: Path | None = None) -> AsyncIterator[Any]:
    from daemon.config import Settings
    from daemon.service import Daemon
    from surfaces.http import HttpOptions, create_app

    over: dict[str, Any] = {"roster_path": roster} if roster else {}
    settings = Settings.from_env(
        state_dir=state / "state", runtime_dir=state / "run", checkpoint_interval_s=3600, **over
    )
    daemon = Daemon(settings)
    await daemon.start()
    try:
        async with served(create_app(daemon, HttpOptions(token=TOKEN))) as base:
            daemon.bench_base = base  # type: ignore[attr-defined]
            yield daemon
    finally:
        await daemon.stop()


def body(prompt: str, tokens: int) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": tokens,
        "temperature": 0.0,
        "seed": 1,
    }


async def post(session: aiohttp.ClientSession, url: str, data: dict[str, Any]) -> dict[str, Any]:
    async with session.post(url, json=data) as resp:
        answer = await resp.json()
        assert resp.status == 200, answer
        return dict(answer)


# ---------------------------------------------------------------- 1. throughput


async def completion_tokens(session: aiohttp.ClientSession, url: str, data: dict[str, Any]) -> int:
    """One call's completion tokens, read from the answer or a stream's usage chunk."""
    async with session.post(url, json=data) as resp:
        assert resp.status == 200, await resp.text()
        if not data.get("stream"):
            return int((await resp.json())["usage"]["completion_tokens"])
        tokens = 0
        async for line in resp.content:
            if line.startswith(b"data: {") and b'"usage"' in line:
                usage = json.loads(line[6:]).get("usage")
                tokens = int(usage["completion_tokens"]) if usage else tokens
        return tokens


async def tokens_per_s(
    session: aiohttp.ClientSession, url: str, c: int, stream: bool = False
) -> float:
    tokens = 0

    async def worker(i: int) -> None:
        nonlocal tokens
        for n in range(REQUESTS):
            data = body(PROMPTS[(i + n) % len(PROMPTS)], 64) | {"model": "tiny"} | SAMPLING
            if stream:
                data |= {"stream": True, "stream_options": {"include_usage": True}}
            tokens += await completion_tokens(session, url, data)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(c)))
    return tokens / (time.perf_counter() - t0)


async def throughput(rows: list[tuple[str, str]]) -> None:
    """Direct calls get what the gateway sends upstream for a non-streamed call, streamed
    (a server tally spawns is always streamed, so a client that leaves stops it) and not."""
    headers = {"Authorization": f"Bearer {TOKEN}"}
    # cpp-httplib closes kept-alive connections after a few requests: a fresh one each time
    fresh = aiohttp.TCPConnector(force_close=True)
    with tempfile.TemporaryDirectory() as tmp:
        async with (
            gateway_daemon(Path(tmp)) as daemon,
            aiohttp.ClientSession(headers=headers, connector=fresh) as session,
        ):
            await daemon.pool.wait_ready("tiny", 120)
            port = daemon.pool.status().members[0].instances[0].port
            direct = f"http://127.0.0.1:{port}/v1/chat/completions"
            gateway = daemon.bench_base + "/v1/chat/completions"
            await tokens_per_s(session, gateway, 2)  # warm both paths
            await tokens_per_s(session, direct, 2)
            for c in (1, 2, 4):
                rates: dict[str, list[float]] = {"plain": [], "streamed": [], "gateway": []}
                for _ in range(ROUNDS):
                    rates["plain"].append(await tokens_per_s(session, direct, c))
                    rates["streamed"].append(await tokens_per_s(session, direct, c, True))
                    rates["gateway"].append(await tokens_per_s(session, gateway, c))
                gw, streamed, plain = (statistics.median(rates[k]) for k in rates)
                ratios = [g / d for g, d in zip(rates["gateway"], rates["streamed"], strict=True)]
                rows.append(
                    (
                        f"throughput c={c}: gateway / direct streamed (target >= 0.97)",
                        f"{statistics.median(ratios):.3f} ({gw:.0f} / {streamed:.0f} tokens/s)",
                    )
                )
                rows.append(
                    (
                        f"throughput c={c}: gateway / direct not streamed",
                        f"{gw / plain:.3f} (direct {plain:.0f} tokens/s)",
                    )
                )


# ---------------------------------------------------------------- 2. added latency


async def p50_ms(fn: Callable[[], Awaitable[Any]], n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        await fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def proxy_app(upstream: str) -> web.Application:
    """A plain reverse proxy: the body through, the answer back, nothing recorded."""
    session: dict[str, aiohttp.ClientSession] = {}

    async def forward(request: web.Request) -> web.Response:
        if "s" not in session:
            session["s"] = aiohttp.ClientSession()
        http = session["s"]
        async with http.post(upstream + request.path, data=await request.read()) as resp:
            return web.Response(body=await resp.read(), content_type="application/json")

    async def close(app: web.Application) -> None:
        if "s" in session:
            await session["s"].close()

    app = web.Application()
    app.router.add_post("/v1/chat/completions", forward)
    app.on_cleanup.append(close)
    return app


async def added_latency(rows: list[tuple[str, str]]) -> None:
    from tests.runs.model_server import roster_toml
    from tests.slots.fake_server import FakeServer

    stub = FakeServer(slots=4, n_ctx=4096)
    await stub.start()
    try:
        results: dict[str, float] = {}
        for where, root in (("disk", None), ("tmpfs", Path("/dev/shm"))):
            with tempfile.TemporaryDirectory(dir=root) as tmp:
                roster = Path(tmp) / "roster.toml"
                roster.write_text(roster_toml(stub.url))
                async with (
                    gateway_daemon(Path(tmp), roster) as daemon,
                    served(proxy_app(stub.url)) as proxy,
                ):
                    results |= await _latencies(where, stub.url, daemon.bench_base, proxy)
    finally:
        await stub.stop()
    for where in ("disk", "tmpfs"):
        added = results[f"{where} gateway"] - results[f"{where} direct"]
        rows.append(
            (
                f"added latency p50 ms, state dir on {where} (target <= 1)",
                f"{added:.2f} (direct {results[f'{where} direct']:.2f}, "
                f"gateway {results[f'{where} gateway']:.2f})",
            )
        )
    proxy_added = results["disk proxy"] - results["disk direct"]
    rows.append(("added latency p50 ms, plain aiohttp reverse proxy", f"{proxy_added:.2f}"))


async def _latencies(where: str, stub: str, gateway: str, proxy: str) -> dict[str, float]:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    data = body("hi", 1) | {"model": "tiny"}
    out: dict[str, list[float]] = {"direct": [], "gateway": [], "proxy": []}
    async with aiohttp.ClientSession(headers=headers) as session:
        urls = {
            "direct": stub + "/v1/chat/completions",
            "gateway": gateway + "/v1/chat/completions",
            "proxy": proxy + "/v1/chat/completions",
        }

        def call(url: str) -> Callable[[], Awaitable[Any]]:
            return lambda: post(session, url, data)

        for url in urls.values():  # warm-up
            await p50_ms(call(url), 20)
        for _ in range(5):  # interleaved rounds
            for name, url in urls.items():
                out[name].append(await p50_ms(call(url), 60))
    return {f"{where} {k}": statistics.median(v) for k, v in out.items()}


# ---------------------------------------------------------------- 3. affinity


SYSTEMS = (
    "You are a careful assistant for a software team. " * 60,
    "You answer questions about gardening, briefly and kindly. " * 60,
)


async def turn(
    session: aiohttp.ClientSession, daemon: Any, messages: list[dict[str, str]]
) -> tuple[str, int, int]:
    """(answer, TTFT µs, cached prompt tokens) of one call."""
    data = {"model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0.0}
    async with session.post(daemon.bench_base + "/v1/chat/completions", json=data) as resp:
        seq = int(resp.headers["X-Tally-Seq"])
        answer = await resp.json()
    reply = (await daemon.ledger.body((await daemon.ledger.get(seq)).body)).value
    text = answer["choices"][0]["message"]["content"]
    return text, int(reply["ttft_us"]), int(reply["usage"]["cached_tokens"])


async def follow_ups(session: aiohttp.ClientSession, daemon: Any) -> list[tuple[int, int]]:
    """Conversations A and B on a 2-slot member, turns A1 B1 B2 A2: least-recently-used slot
    choice sends B2 to A's slot (and A2 to B's); affinity keeps each on its own. Returns
    (TTFT µs, cached tokens) of B2 and A2."""
    talks = [
        [{"role": "system", "content": s}, {"role": "user", "content": "Hello."}] for s in SYSTEMS
    ]
    out = []
    for who in (0, 1, 1, 0):
        text, ttft, cached = await turn(session, daemon, talks[who])
        talks[who] += [{"role": "assistant", "content": text}, {"role": "user", "content": "More?"}]
        out.append((ttft, cached))
    return out[2:]


async def affinity(rows: list[tuple[str, str]]) -> None:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    results: dict[str, list[tuple[int, int]]] = {"with": [], "without": []}
    with tempfile.TemporaryDirectory() as tmp:
        async with (
            gateway_daemon(Path(tmp)) as daemon,
            aiohttp.ClientSession(headers=headers) as session,
        ):
            await daemon.pool.wait_ready("tiny", 120)
            roster = daemon.roster
            for _ in range(ROUNDS):
                for mode in ("with", "without"):
                    keep = roster.gateway.model_copy(update={"affinity": mode == "with"})
                    daemon.gateway.set_roster(roster.model_copy(update={"gateway": keep}))
                    results[mode] += await follow_ups(session, daemon)
    for mode in ("with", "without"):
        ttft = statistics.median(t for t, _ in results[mode]) / 1000
        cached = statistics.median(c for _, c in results[mode])
        rows.append(
            (
                f"follow-up turn {mode} affinity: TTFT ms, cached prompt tokens",
                f"{ttft:.1f}, {cached:.0f}",
            )
        )


def main() -> None:
    rows: list[tuple[str, str]] = []
    asyncio.run(added_latency(rows))
    asyncio.run(throughput(rows))
    asyncio.run(affinity(rows))
    print_rows(rows)


if __name__ == "__main__":
    main()
