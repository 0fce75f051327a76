"""Constrained decoding on the embedded model: how often a schema task's answer is valid.

The same 24 prompts asking for JSON go to the real embedded server (xllamacpp + SmolLM2,
the default roster's `tiny`, leased through the pool) twice, interleaved: once with the
task's schema sent as `response_format` (what the engine does for a task with a
`json_schema` assertion), once without. An answer passes when it parses as JSON (after the
guard's rescue of a fenced or embedded object) and validates against the schema.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from jsonschema import Draft202012Validator

from tests.bench.table import print_rows

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "minLength": 1, "maxLength": 80},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "priority": {"type": "integer", "minimum": 1, "maximum": 5},
    },
    "required": ["title", "tags", "priority"],
    "additionalProperties": False,
}
TOPICS = [
    "a login page bug",
    "slow database queries",
    "a typo in the README",
    "a memory leak",
    "flaky tests in CI",
    "a new dark mode",
    "an expired TLS certificate",
    "a broken build",
    "missing translations",
    "a crash on start",
    "an API rate limit",
    "a disk filling up",
    "a slow page load",
    "an outdated dependency",
    "a wrong timezone",
    "a failing backup",
    "a confusing error message",
    "an unused feature flag",
    "a race condition",
    "a bad cache",
    "a security advisory",
    "a support ticket backlog",
    "a logo change",
    "a data export",
]


def passes(text: str) -> bool:
    import json

    from daemon.runs.guard import first_balanced_object

    candidate = text.strip()
    if not candidate.startswith("{"):
        candidate = first_balanced_object(candidate) or ""
    try:
        data = json.loads(candidate)
    except ValueError:
        return False
    return Draft202012Validator(SCHEMA).is_valid(data)


async def measure(rows: list[tuple[str, str]]) -> None:
    from daemon.config import Settings
    from daemon.runs import guard
    from daemon.service import Daemon

    with tempfile.TemporaryDirectory() as tmp:
        settings = Settings.from_env(
            state_dir=Path(tmp) / "state", runtime_dir=Path(tmp) / "run", checkpoint_interval_s=3600
        )
        daemon = Daemon(settings)
        await daemon.start()
        try:
            await daemon.pool.wait_ready("tiny", 120)
            results: dict[str, list[bool]] = {"with": [], "without": []}
            seconds: dict[str, list[float]] = {"with": [], "without": []}
            for topic in TOPICS:
                messages = [
                    {"role": "system", "content": "You answer with JSON only."},
                    {
                        "role": "user",
                        "content": f"Describe {topic} as a ticket: JSON with title (string), "
                        "tags (list of strings) and priority (integer 1-5).",
                    },
                ]
                for mode in ("with", "without"):
                    fmt = guard.response_format("task_output", SCHEMA) if mode == "with" else None
                    t0 = time.perf_counter()
                    async with daemon.pool.lease("tiny") as lease:
                        reply = await lease.chat(messages, max_tokens=160, response_format=fmt)
                    seconds[mode].append(time.perf_counter() - t0)
                    results[mode].append(passes(reply.text))
        finally:
            await daemon.stop()
    for mode in ("with", "without"):
        ok = sum(results[mode])
        rows.append(
            (
                f"schema task pass rate {mode} constrained decoding ({len(TOPICS)} prompts)",
                f"{ok}/{len(TOPICS)} = {ok / len(TOPICS):.0%}, "
                f"median {statistics.median(seconds[mode]):.2f} s per call",
            )
        )


def main() -> None:
    rows: list[tuple[str, str]] = []
    asyncio.run(measure(rows))
    print_rows(rows)


if __name__ == "__main__":
    main()
