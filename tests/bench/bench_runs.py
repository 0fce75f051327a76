"""Runs benchmark: the scheduler on generated DAGs, engine overhead per task, 1,000 runs.

1. Scheduler: random DAGs with known task durations on N slots. Makespan against the lower
   bound max(critical path, total work / N), and against barrier (wave-by-wave) mode. The
   dispatcher is given unit costs, as in the engine (which knows no durations); the
   executors sleep the known durations. A second column is the same schedule simulated
   without the event loop's overhead (pure ordering quality).
2. Engine overhead per task with an instant stub executor and the ledger on: the time from
   a task's `task.start` to its `task.verdict` (three fsynced appends), p50 and p90, and the
   amortized time per task when 64 runs go at once.
3. 1,000 concurrent runs of 3 stub tasks (+ an instant fake synthesis call): every run
   terminal, peak RSS, ledger verified.
4. Start-up: `Daemon.start()` over a ledger of 1M filler entries plus N finished runs, with
   the run-state snapshot and without it (full replay), against opening the ledger alone.
5. Run overhead at c=1: the real daemon (file ledger, slot pool, HTTP client) against the
   scripted fake llama-server of tests/runs in this process over loopback, answering at once
   (zero latency): p50 / p90 wall time of one routed one-task run, submit to done, one run at
   a time. Beside it, the same number of sequential ledger appends alone (what the run's
   causal chain costs in fsyncs at least) and the ledger's batches per run.

`python -m tests.bench.bench_runs overhead` runs only the last section.
"""

from __future__ import annotations

import asyncio
import gc
import importlib
import random
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from daemon.config import Settings
from daemon.ledger import Ledger
from daemon.ledger.bulk import build
from daemon.runs import snapshot as snapshots
from daemon.runs.dispatch import Capacity, Node, dispatch, ranks
from daemon.runs.engine import Engine, EngineOptions
from daemon.runs.state import FINAL
from daemon.service import Daemon
from tests.runs.fakes import KeywordRouter, MemoryLedger, ScriptedPool, make_roster
from tests.runs.model_server import ScriptedServer, roster_toml, settings_for

SEED = 7


def make_dag(rng: random.Random, n: int, p: float) -> list[Node]:
    nodes: list[Node] = []
    for i in range(n):
        needs = tuple(f"t{j}" for j in range(max(0, i - 8), i) if rng.random() < p)
        nodes.append(Node(f"t{i}", "x", needs, cost=rng.uniform(0.02, 0.08)))
    return nodes


def unit(nodes: list[Node]) -> list[Node]:
    """What the engine's dispatcher sees: the DAG without durations."""
    return [Node(n.id, n.lane, n.needs) for n in nodes]


async def simulated(nodes: list[Node], slots: int) -> float:
    """The dispatcher's own order on a virtual clock: no timer or event-loop overhead."""
    by_id = {n.id: n for n in nodes}
    clock = 0.0
    running: dict[str, asyncio.Future[bool]] = {}
    loop = asyncio.get_running_loop()

    async def execute(task_id: str) -> bool:
        future: asyncio.Future[bool] = loop.create_future()
        running[task_id] = future
        return await future

    async def advance() -> None:
        nonlocal clock
        finish: dict[str, float] = {}
        while True:
            for _ in range(20):  # let the dispatcher react and start what became ready
                await asyncio.sleep(0)
            for task_id in running:
                finish.setdefault(task_id, clock + by_id[task_id].cost)
            if not running:
                if driver.done():
                    return
                continue
            task_id = min(running, key=lambda t: finish[t])
            clock = finish.pop(task_id)
            running.pop(task_id).set_result(True)

    driver = asyncio.ensure_future(
        dispatch(unit(nodes), execute, max_parallel=slots, capacity=Capacity(total=slots))
    )
    await asyncio.gather(driver, advance())
    return clock


async def makespan(nodes: list[Node], slots: int, barrier: bool) -> float:
    by_id = {n.id: n for n in nodes}

    async def execute(task_id: str) -> bool:
        await asyncio.sleep(by_id[task_id].cost)
        return True

    started = time.monotonic()
    await dispatch(
        unit(nodes), execute, max_parallel=slots, capacity=Capacity(total=slots), barrier=barrier
    )
    return time.monotonic() - started


async def scheduler_rows() -> list[str]:
    rng = random.Random(SEED)
    rows = []
    for slots in (2, 4, 8):
        bound_ratios, barrier_ratios, sim_ratios = [], [], []
        for _ in range(5):
            nodes = make_dag(rng, 30, 0.25)
            critical = max(ranks(nodes).values())
            bound = max(critical, sum(n.cost for n in nodes) / slots)
            live = await makespan(nodes, slots, barrier=False)
            waves = await makespan(nodes, slots, barrier=True)
            bound_ratios.append(live / bound)
            sim_ratios.append(await simulated(nodes, slots) / bound)
            barrier_ratios.append(waves / live)
        rows.append(
            f"| scheduler, 30-task DAGs, {slots} slots | makespan / max(CP, work/slots) | "
            f"{statistics.median(bound_ratios):.3f} (max {max(bound_ratios):.3f}); "
            f"ordering alone {statistics.median(sim_ratios):.3f} (max {max(sim_ratios):.3f})"
            " | ≤ 1.05 |"
        )
        rows.append(
            f"| scheduler, 30-task DAGs, {slots} slots | barrier makespan / dependency-driven | "
            f"{statistics.median(barrier_ratios):.3f} | > 1 |"
        )
    return rows


def stub_plan(n: int, chain: bool = False) -> dict[str, Any]:
    return {
        "tasks": [
            {
                "id": f"s{i}",
                "lane": "backend",
                "instruction": f"step {i}",
                "executor": "stub",
                "needs": [f"s{i - 1}"] if chain and i else [],
            }
            for i in range(n)
        ]
    }


async def open_ledger(state_dir: Path) -> tuple[Any, str]:
    try:
        module = importlib.import_module("daemon.ledger")
    except ImportError:
        return MemoryLedger(), "in-memory fake (daemon.ledger not available)"
    ledger = await module.Ledger.open(state_dir)
    return ledger, "file ledger (fsync)"


def engine_on(ledger: Any, max_runs: int = 64) -> Engine:
    roster = make_roster(max_runs=max_runs, max_parallel=8)
    pool = ScriptedPool(roster, lambda member, messages: "combined", slots=64)
    return Engine(ledger, pool, roster, KeywordRouter(roster), options=EngineOptions())


async def task_latencies(ledger: Any, run_ids: list[str]) -> list[float]:
    out = []
    for run_id in run_ids:
        starts: dict[str, int] = {}
        for entry in await ledger.entries(start=0, limit=100_000, run=run_id):
            if entry.kind == "task.start":
                body = (await ledger.body(entry.body)).value
                starts[body["task"]] = entry.ts
            elif entry.kind == "task.verdict":
                body = (await ledger.body(entry.body)).value
                out.append((entry.ts - starts[body["task"]]) / 1000)
    return out


async def overhead_rows() -> list[str]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ledger, what = await open_ledger(Path(tmp))
        engine = engine_on(ledger)
        ids = []
        for _ in range(20):  # sequential runs: per-task latency without contention
            view = await engine.submit("backend", plan=stub_plan(5, chain=True))
            await engine.wait(view.id)
            ids.append(view.id)
        lat = sorted(await task_latencies(ledger, ids))
        rows.append(
            f"| engine overhead per task (start→verdict, {what}) | p50 / p90 ms | "
            f"{statistics.median(lat):.2f} / {lat[int(len(lat) * 0.9)]:.2f} | p50 ≤ 2 |"
        )
        started = time.monotonic()
        views = [await engine.submit("backend", plan=stub_plan(5)) for _ in range(64)]
        await asyncio.gather(*(engine.wait(v.id) for v in views))
        per_task = (time.monotonic() - started) * 1000 / (64 * 5)
        rows.append(
            f"| engine time per task, 64 runs × 5 tasks at once ({what}) | ms (amortized) | "
            f"{per_task:.2f} | — |"
        )
        if hasattr(ledger, "close"):
            await ledger.close()
    return rows


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


async def thousand_rows() -> list[str]:
    with tempfile.TemporaryDirectory() as tmp:
        ledger, what = await open_ledger(Path(tmp))
        engine = engine_on(ledger, max_runs=1000)
        gc.collect()
        started = time.monotonic()
        views = await asyncio.gather(
            *(engine.submit(f"backend run {i}", plan=stub_plan(3)) for i in range(1000))
        )
        finals = await asyncio.gather(*(engine.wait(v.id) for v in views))
        elapsed = time.monotonic() - started
        terminal = sum(1 for v in finals if v.state in FINAL)
        done = sum(1 for v in finals if v.state == "done")
        verified = "n/a"
        if hasattr(ledger, "verify"):
            report = await ledger.verify()
            verified = "ok" if report.ok else f"FAILED at {report.first_bad_seq}"
        entries = ledger.size
        if hasattr(ledger, "close"):
            await ledger.close()
    return [
        f"| 1,000 concurrent runs × 3 tasks ({what}) | terminal / done | "
        f"{terminal} / {done} in {elapsed:.1f} s, {entries} entries | 1000 |",
        f"| 1,000 concurrent runs × 3 tasks | peak RSS MB | {rss_mb():.0f} | ≤ 300 |",
        f"| 1,000 concurrent runs × 3 tasks | ledger verifies | {verified} | ok |",
    ]


FILLER = 1_000_000
STARTUP_RUNS = (500, 2000)


async def timed_start(settings: Settings) -> tuple[float, int | None]:
    daemon = Daemon(settings)
    started = time.perf_counter()
    await daemon.start()
    took = time.perf_counter() - started
    restored = daemon.restored_from
    await daemon.stop()
    return took, restored


async def startup_rows() -> list[str]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        state = Path(tmp) / "state"
        build(state, FILLER)  # history the runs sit on: the ledger itself opens in ms
        roster = Path(tmp) / "roster.toml"
        roster.write_text(roster_toml("http://127.0.0.1:9/v1"))  # lazy pool: never contacted
        settings = Settings.from_env(
            state_dir=state, runtime_dir=Path(tmp) / "run", roster_path=roster, drain_s=0
        )
        made = 0
        for runs in STARTUP_RUNS:
            ledger = await Ledger.open(state)
            engine = engine_on(ledger, max_runs=1000)
            views = await asyncio.gather(
                *(engine.submit(f"backend {i}", plan=stub_plan(3)) for i in range(runs - made))
            )
            await asyncio.gather(*(engine.wait(v.id) for v in views))
            made = runs
            entries = ledger.size
            await ledger.close()
            (state / snapshots.FILE).unlink(missing_ok=True)
            opened = time.perf_counter()
            ledger = await Ledger.open(state)
            open_s = time.perf_counter() - opened
            await ledger.close()
            full, restored = await timed_start(settings)  # no snapshot: replays everything
            assert restored is None
            fast, restored = await timed_start(settings)  # from the snapshot the stop wrote
            assert restored is not None
            what = f"{runs} runs, {entries:,} entries"
            rows.append(f"| start-up, {what}: ledger open alone | ms | {open_s * 1000:.0f} | — |")
            rows.append(
                f"| start-up, {what}: Daemon.start, full replay | ms | {full * 1000:.0f} | — |"
            )
            rows.append(
                f"| start-up, {what}: Daemon.start from the snapshot | ms | {fast * 1000:.0f} "
                f"({full / fast:.0f}× faster) | bounded |"
            )
    return rows


ROUNDS_C1 = 10
PER_ROUND_C1 = 30
WARMUP_C1 = 30


def percentiles(samples: list[float]) -> tuple[float, float]:
    ordered = sorted(samples)
    return statistics.median(ordered), ordered[int(len(ordered) * 0.9)]


async def chained_appends(ledger: Ledger, name: str, n: int) -> float:
    """ms for `n` sequential appends, each the parent of the next (as in a run's chain)."""
    started = time.perf_counter()
    parent = None
    for j in range(n):
        body = {"n": j, "text": "x" * 64}
        entry = await ledger.append(actor="bench", kind="bench", body=body, run=name, parent=parent)
        parent = entry.seq
    return (time.perf_counter() - started) * 1000


async def one_run(engine: Engine, i: int) -> float:
    """ms from submit to done of one routed one-task run."""
    started = time.perf_counter()
    view = await engine.submit(f"fix the backend handler {i}")
    done = await engine.wait(view.id, timeout=30)
    assert done.state == "done", done.error
    return (time.perf_counter() - started) * 1000


async def run_overhead_rows() -> list[str]:
    """Rounds alternate runs and bare chains on a second ledger (same disk): noise hits both."""
    with tempfile.TemporaryDirectory() as tmp:
        server = ScriptedServer([], default="done")
        await server.start()
        daemon = Daemon(settings_for(Path(tmp), roster_toml(server.url)))
        await daemon.start()
        bare_ledger = await Ledger.open(Path(tmp) / "bare")
        try:
            engine, ledger = daemon.engine, daemon.ledger
            size = ledger.size
            for i in range(WARMUP_C1):
                await one_run(engine, i)
            per_run = round((ledger.size - size) / WARMUP_C1)
            size, batches = ledger.size, ledger.stats.batches
            runs: list[float] = []
            bare: list[float] = []
            for r in range(ROUNDS_C1):
                for i in range(PER_ROUND_C1):
                    runs.append(await one_run(engine, i))
                for i in range(PER_ROUND_C1):
                    bare.append(await chained_appends(bare_ledger, f"b{r}.{i}", per_run))
            n = ROUNDS_C1 * PER_ROUND_C1
            entries, commits = (ledger.size - size) / n, (ledger.stats.batches - batches) / n
        finally:
            await bare_ledger.close()
            await daemon.stop()
            await server.stop()
    p50, p90 = percentiles(runs)
    b50, b90 = percentiles(bare)
    return [
        f"| run overhead at c=1, zero-latency stub over loopback ({n} runs: {entries:.0f} "
        f"entries, {commits:.1f} group commits each) | p50 / p90 ms | {p50:.2f} / {p90:.2f} "
        "| p50 ≤ 8 |",
        f"| reference: {per_run} chained ledger appends in turn, interleaved | p50 / p90 ms | "
        f"{b50:.2f} / {b90:.2f} | — |",
        f"| run overhead above its appends alone | p50 ratio | {p50 / b50:.2f} | — |",
    ]


async def amain(sections: list[str] | None = None) -> None:
    rows = ["| measure | unit | result | target |", "|---|---|---|---|"]
    if not sections:
        rows += await scheduler_rows()
        rows += await overhead_rows()
        rows += await thousand_rows()
        rows += await startup_rows()
    rows += await run_overhead_rows()
    print("\n".join(rows))


def main() -> None:
    asyncio.run(amain())


if __name__ == "__main__":
    asyncio.run(amain(sys.argv[1:]))
