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
   Beside that, forum-engine 1.17 (the `bench` extra; a "not installed" row without it) doing
   the equivalent in the same rounds: one request submitted and answered end to end, in
   process, as `forum submit` and its daemon's `POST /submit` do it (`build_orchestrator` with
   a file ledger, `Orchestrator.submit`, then `submit_receipt`), its `--chat-url` executor
   (ChatExecutor) on a second zero-latency scripted server. It differs from tally's run: its
   executor makes four model calls per request (a plan, asked as JSON and answered with one
   task; the task; a validator verdict, asked as JSON; the synthesis), each a new connection
   from a worker thread; it fsyncs every ledger append on its event loop (where its stub, like
   tally's, also answers, so those fsyncs hold up the stub too); and the receipt deep-verifies
   its whole ledger, so that part grows with history (the ledger starts empty here). Last,
   runs/s at c=8 (8 clients, each one run at a time) for both, in alternating 1 s rounds.

`python -m tests.bench.bench_runs overhead` runs only the last section.
"""

from __future__ import annotations

import asyncio
import gc
import importlib
import json
import random
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from daemon.config import Settings
from daemon.ledger import Ledger
from daemon.ledger.bulk import build
from daemon.runs import snapshot as snapshots
from daemon.runs.dispatch import Capacity, Node, dispatch, ranks
from daemon.runs.engine import Engine, EngineOptions
from daemon.runs.executors import echo_stub
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
    return Engine(
        ledger, pool, roster, KeywordRouter(roster), options=EngineOptions(), stub=echo_stub
    )


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
STARTUP_BATCH = 1000  # runs submitted at once: the engine's max_runs here


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
            engine = engine_on(ledger, max_runs=STARTUP_BATCH)
            for first in range(made, runs, STARTUP_BATCH):  # admission caps runs in flight
                views = await asyncio.gather(
                    *(
                        engine.submit(f"backend {i}", plan=stub_plan(3))
                        for i in range(first, min(runs, first + STARTUP_BATCH))
                    )
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


FORUM_PER_ROUND_C1 = 10
FORUM_WARMUP_C1 = 10
C8 = 8
C8_ROUND_S = 1.0
C8_ROUNDS = 3
# forum's Coordinator and Validator prompts begin with these words (forum.control); the stub
# answers each with what forum parses from it, and everything else (the task, the synthesis)
# with "done".
FORUM_RULES: list[tuple[str, str | list[str], float]] = [
    (
        "You are a planner",
        json.dumps(
            {
                "tasks": [
                    {
                        "id": "T1",
                        "agent": "backend",
                        "instruction": "fix the backend handler",
                        "depends_on": [],
                    }
                ]
            }
        ),
        0.0,
    ),
    ("Judge whether the output satisfies", json.dumps({"ok": True, "score": 1.0}), 0.0),
]


class ForumRig:
    """forum-engine's Orchestrator as `forum submit --chat-url` and `POST /submit` build it."""

    def __init__(self, orchestrator: Any, executor: Any, receipt: Callable[..., Any]) -> None:
        self.orchestrator = orchestrator
        self.executor = executor
        self.receipt = receipt

    async def one(self, i: int) -> tuple[float, float]:
        """ms from submit to the answer and its receipt (what /submit returns), and ms of
        `Orchestrator.submit` alone."""
        ledger = self.orchestrator.ledger
        request = f"fix the backend handler {i}"
        started = time.perf_counter()
        before = ledger.count()
        answer = await self.orchestrator.submit(request)
        answered = time.perf_counter()
        receipt = self.receipt(
            ledger, before_seq=before, request=request, answer=answer, executor=self.executor
        )
        done = time.perf_counter()
        assert answer == "done", answer
        assert receipt["ledger"]["verified"], receipt
        return (done - started) * 1000, (answered - started) * 1000

    def verdicts(self) -> tuple[int, int]:
        """(passing, all) validator verdicts in forum's ledger: a stub answer forum did not
        accept would fail the task without failing `submit`."""
        ledger = self.orchestrator.ledger
        found = [e for e in ledger.replay() if e.kind == "verdict"]
        return sum(1 for e in found if ledger.get_payload(e.payload_hash)["ok"] is True), len(found)


@asynccontextmanager
async def forum_rig(tmp: Path) -> AsyncIterator[ForumRig | None]:
    """forum-engine on its own zero-latency stub, its ledger under `tmp`; None when the `bench`
    extra is not installed."""
    try:
        from forum.chat_executor import ChatExecutor
        from forum.daemon import build_orchestrator
        from forum.receipts import submit_receipt
    except ImportError:
        yield None
        return
    server = ScriptedServer(FORUM_RULES, default="done")
    await server.start()
    try:
        executor = ChatExecutor("stub", base_url=f"{server.url}/chat/completions")
        orchestrator = build_orchestrator(str(tmp / "forum-ledger"), executor=executor)
        yield ForumRig(orchestrator, executor, submit_receipt)
    finally:
        await server.stop()


async def runs_per_s(one: Callable[[int], Awaitable[object]]) -> float:
    """Runs/s of C8 clients, each submitting its next run when its last one is done, for
    C8_ROUND_S (a bounded time, not a count: forum is an order of magnitude slower)."""
    started = time.perf_counter()
    stop = started + C8_ROUND_S
    done = 0

    async def client(k: int) -> None:
        nonlocal done
        j = 0
        while time.perf_counter() < stop:
            await one(k * 1000 + j)
            done += 1
            j += 1

    await asyncio.gather(*(client(k) for k in range(C8)))
    return done / (time.perf_counter() - started)


async def run_overhead_rows() -> list[str]:
    """Rounds alternate runs and bare chains on a second ledger (same disk): noise hits both."""
    with tempfile.TemporaryDirectory() as tmp:
        server = ScriptedServer([], default="done")
        await server.start()
        daemon = Daemon(settings_for(Path(tmp), roster_toml(server.url)))
        await daemon.start()
        bare_ledger = await Ledger.open(Path(tmp) / "bare")
        try:
            async with forum_rig(Path(tmp)) as forum:
                engine, ledger = daemon.engine, daemon.ledger
                size = ledger.size
                for i in range(WARMUP_C1):
                    await one_run(engine, i)
                per_run = round((ledger.size - size) / WARMUP_C1)
                if forum is not None:
                    for i in range(FORUM_WARMUP_C1):
                        await forum.one(i)
                    forum_size = forum.orchestrator.ledger.count()
                size, batches = ledger.size, ledger.stats.batches
                runs: list[float] = []
                bare: list[float] = []
                forum_runs: list[float] = []
                forum_submits: list[float] = []
                for r in range(ROUNDS_C1):
                    for i in range(PER_ROUND_C1):
                        runs.append(await one_run(engine, i))
                    for i in range(PER_ROUND_C1):
                        bare.append(await chained_appends(bare_ledger, f"b{r}.{i}", per_run))
                    if forum is not None:
                        for i in range(FORUM_PER_ROUND_C1):
                            total, submit = await forum.one(i)
                            forum_runs.append(total)
                            forum_submits.append(submit)
                n = ROUNDS_C1 * PER_ROUND_C1
                entries, commits = (ledger.size - size) / n, (ledger.stats.batches - batches) / n
                if forum is not None:
                    forum_entries = (forum.orchestrator.ledger.count() - forum_size) / len(
                        forum_runs
                    )
                tally_c8: list[float] = []
                forum_c8: list[float] = []
                for _ in range(C8_ROUNDS):
                    tally_c8.append(await runs_per_s(lambda i: one_run(engine, i)))
                    if forum is not None:
                        forum_c8.append(await runs_per_s(forum.one))
                if forum is not None:
                    passing, verdicts = forum.verdicts()
                    assert passing == verdicts, f"forum: {passing} of {verdicts} verdicts passed"
                    forum_ledger = forum.orchestrator.ledger.count()
        finally:
            await bare_ledger.close()
            await daemon.stop()
            await server.stop()
    p50, p90 = percentiles(runs)
    b50, b90 = percentiles(bare)
    rows = [
        f"| run overhead at c=1, zero-latency stub over loopback ({n} runs: {entries:.0f} "
        f"entries, {commits:.1f} group commits each) | p50 / p90 ms | {p50:.2f} / {p90:.2f} "
        "| p50 ≤ 8 |",
        f"| reference: {per_run} chained ledger appends in turn, interleaved | p50 / p90 ms | "
        f"{b50:.2f} / {b90:.2f} | — |",
        f"| run overhead above its appends alone | p50 ratio | {p50 / b50:.2f} | — |",
    ]
    if forum is None:
        rows.append("| forum-engine runs | — | not installed (pip install -e '.[bench]') | — |")
        rows.append(
            f"| runs at c={C8}, tally ({C8_ROUND_S:g} s rounds, median of {C8_ROUNDS}) | runs/s "
            f"| {statistics.median(tally_c8):.0f} | — |"
        )
        return rows
    f50, f90 = percentiles(forum_runs)
    s50, _ = percentiles(forum_submits)
    ratios = [t / f for t, f in zip(tally_c8, forum_c8, strict=True)]
    rows += [
        f"| forum-engine 1.17 at c=1, one request submitted and answered, zero-latency stub "
        f"({len(forum_runs)} runs, interleaved: {forum_entries:.0f} entries, 4 model calls "
        "each; receipt included, as /submit) | p50 / p90 ms | "
        f"{f50:.2f} / {f90:.2f} (Orchestrator.submit alone: p50 {s50:.2f}) | — |",
        f"| forum-engine run / tally run at c=1 | p50 ratio | {f50 / p50:.2f} | — |",
        f"| runs at c={C8} ({C8} clients, {C8_ROUND_S:g} s rounds alternating, median of "
        f"{C8_ROUNDS}) | runs/s | tally {statistics.median(tally_c8):.0f}, forum-engine 1.17 "
        f"{statistics.median(forum_c8):.1f} (rounds: {', '.join(f'{r:.1f}' for r in forum_c8)}; "
        f"each receipt deep-verifies its whole ledger, {forum_ledger:,} entries at the end): "
        f"tally = {statistics.median(ratios):.2f} × forum | — (issue: 144 vs 38.5) |",
    ]
    return rows


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
