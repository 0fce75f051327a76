"""Planner benchmark: a generated 10,000-task DAG validated and waved.

The reference is a bare topological sort of the same DAG with the standard library's
`graphlib.TopologicalSorter`, timed in the same run; ratios are against its median.
Run: `python -m tests.bench bench_planning`.
"""

from __future__ import annotations

import gc
import graphlib
import json
import random
import statistics
import time
from collections.abc import Callable

from daemon.plans import Plan, check_plan, parse_plan, problems, waves

TASKS = 10_000
RUNS = 11
LANES = ["backend", "frontend", "database", "testing", "docs"]


def generate(n: int = TASKS, seed: int = 1) -> str:
    """Each task needs up to 3 of the 50 tasks before it: ~30k edges, a deep DAG."""
    rng = random.Random(seed)
    tasks = [
        {
            "id": f"T{i}",
            "lane": rng.choice(LANES),
            "instruction": f"step {i}",
            "needs": [f"T{j}" for j in rng.sample(range(max(0, i - 50), i), min(i, 3))],
        }
        for i in range(n)
    ]
    return json.dumps({"tasks": tasks})


def medians_ms(rows: list[tuple[str, Callable[[], object]]]) -> list[tuple[str, float]]:
    """Round-robin over the rows, so noise from other processes lands on all of them alike.

    Like `timeit`, the collector is paused while a step runs: otherwise a full collection
    that happens to fall inside a step (it walks every live object, i.e. both 10k plans)
    is charged to whichever step was unlucky.
    """
    times: list[list[float]] = [[] for _ in rows]
    for _ in range(RUNS):
        for i, (_, fn) in enumerate(rows):
            gc.collect()
            gc.disable()
            start = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - start)
            gc.enable()
    return [(name, statistics.median(t) * 1000) for (name, _), t in zip(rows, times, strict=True)]


def main() -> None:
    text = generate()
    plan = parse_plan(text)
    edges = sum(len(t.needs) for t in plan.tasks)
    cyclic = Plan(
        tasks=[
            t.model_copy(update={"needs": [*t.needs, f"T{TASKS - 1}"]}) if t.id == "T0" else t
            for t in plan.tasks
        ]
    )

    def reference() -> None:
        graph = {t.id: t.needs for t in plan.tasks}
        list(graphlib.TopologicalSorter(graph).static_order())

    def validate_and_wave() -> None:
        check_plan(plan, LANES)
        waves(plan, 8)

    def end_to_end(source: str) -> None:
        parsed = parse_plan(source)
        check_plan(parsed, LANES)
        waves(parsed, 8)

    rows: list[tuple[str, Callable[[], object]]] = [
        ("reference: graphlib topological sort", reference),
        ("validate (check_plan)", lambda: check_plan(plan, LANES)),
        ("waves (max_parallel=8)", lambda: waves(plan, 8)),
        ("**validate + waves**", validate_and_wave),
        ("parse JSON into Plan (pydantic)", lambda: parse_plan(text)),
        ("parse + validate + waves", lambda: end_to_end(text)),
        ("validate a plan with one 10k-task cycle", lambda: problems(cyclic, LANES)),
    ]
    results = medians_ms(rows)
    base = results[0][1]
    result = waves(plan, 8)
    print(f"{TASKS} tasks, {edges} needs, {result.critical_path} levels, {len(result.waves)} waves")
    print(f"median of {RUNS} runs\n")
    print("| step | median ms | × graphlib sort |")
    print("|---|---:|---:|")
    for name, ms in results:
        print(f"| {name} | {ms:.1f} | {ms / base:.2f} |")
    total = results[3][1]
    print(
        f"\ntarget: validate + waves ≤ 100 ms → {total:.1f} ms "
        f"({'met' if total <= 100 else 'MISSED'} on this run)"
    )
