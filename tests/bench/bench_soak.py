"""Soak benchmark: 5,000 runs on a real daemon with the default run-memory bounds.

Each run is a sandboxed command task printing 64 KiB (distinct per run). Halfway through, 20
SSE clients replay backlogs, `ledger_summary` reads the whole ledger and a body is redacted
while the body table grows (see `tests/runs/soak.py`). Targets (issue 15): worst `/healthz`
latency and worst event-loop lag ≤ 50 ms; RSS after 5,000 runs within 1.3× of RSS after 500;
snapshot write time flat with the run count. The soak runs twice; the table quotes both
rounds and, for the ratios, their median. Worst-case figures on a shared 2-core machine are
noisy: the p99 beside them says how rare a spike was.
"""

from __future__ import annotations

import asyncio
import shutil
import statistics
import tempfile
from pathlib import Path

from tests.runs.soak import SoakResult, soak

RUNS = 5_000
EARLY = 500
ROUNDS = 2


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _row(name: str, values: list[str], target: str) -> None:
    print(f"| {name} | {' | '.join(values)} | {target} |")


def main() -> None:
    if shutil.which("bwrap") is None:
        print("bubblewrap is not installed: the soak runs command tasks, skipped")
        return
    results: list[SoakResult] = []
    for _ in range(ROUNDS):
        with tempfile.TemporaryDirectory() as tmp:
            results.append(asyncio.run(soak(Path(tmp), runs=RUNS, early=EARLY)))
    heads = " | ".join(f"round {i + 1}" for i in range(ROUNDS))
    print(f"| measure | {heads} | target |")
    print("|---|" + "---|" * ROUNDS + "---|")
    ms = [f"{r.wall_s:.1f} s ({r.runs / r.wall_s:.0f} runs/s)" for r in results]
    _row(f"{RUNS} runs, 64 KiB output each", ms, "–")
    _row("failed runs", [str(r.failed_runs) for r in results], "0")
    _row(
        "/healthz worst (p99, p50)",
        [
            f"{max(r.healthz_s) * 1e3:.1f} ms ({_p(r.healthz_s, 0.99) * 1e3:.1f}, "
            f"{statistics.median(r.healthz_s) * 1e3:.1f})"
            for r in results
        ],
        "≤ 50 ms",
    )
    _row("event-loop lag worst", [f"{r.lag_worst_s * 1e3:.1f} ms" for r in results], "≤ 50 ms")
    rss = [r.samples[-1].rss_bytes / r.samples[0].rss_bytes for r in results]
    _row(
        f"RSS after {RUNS} / after ~{EARLY}",
        [
            f"{r.samples[-1].rss_bytes / 2**20:.0f} / {r.samples[0].rss_bytes / 2**20:.0f} MiB "
            f"= {x:.2f}"
            for r, x in zip(results, rss, strict=True)
        ],
        f"≤ 1.3 (median {statistics.median(rss):.2f})",
    )
    _row(
        "snapshot write, loop share: early / end",
        [
            f"{r.samples[0].snapshot_loop_s * 1e3:.2f} / "
            f"{r.samples[-1].snapshot_loop_s * 1e3:.2f} ms"
            for r in results
        ],
        "flat",
    )
    snap = [r.samples[-1].snapshot_total_s / r.samples[0].snapshot_total_s for r in results]
    _row(
        "snapshot write, whole: early / end (runs in memory)",
        [
            f"{r.samples[0].snapshot_total_s * 1e3:.0f} ms ({r.samples[0].views}) / "
            f"{r.samples[-1].snapshot_total_s * 1e3:.0f} ms ({r.samples[-1].views})"
            for r in results
        ],
        f"flat (median ratio {statistics.median(snap):.2f})",
    )
    _row(
        "ledger_summary over the whole ledger",
        [f"{r.summary_s * 1e3:.0f} ms ({r.summary_entries} entries)" for r in results],
        "–",
    )
    _row(
        "20 SSE backlog replays: events; redaction done; body table slots",
        [f"{r.sse_events}; {r.redacted}; {r.table_slots[0]} → {r.table_slots[1]}" for r in results],
        "–",
    )
