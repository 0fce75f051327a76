"""The three-task plan (api, then docs and tests) the daemon run tests submit, its scripted
replies, and how they read a run's entries back."""

from __future__ import annotations

from typing import Any

from daemon.service import Daemon
from tests.runs.model_server import Reply

DAG = {
    "tasks": [
        {"id": "api", "lane": "backend", "instruction": "Design the API."},
        {"id": "doc", "lane": "docs", "instruction": "Document it.", "needs": ["api"]},
        {"id": "test", "lane": "testing", "instruction": "Test it.", "needs": ["api"]},
    ]
}


DAG_RULES: list[tuple[str, Reply, float]] = [
    ("Combine", "FINAL ANSWER about the api, docs and tests", 0.0),
    ("Design the API", "GET /items", 0.0),
    ("Document it", "docs for GET /items", 0.0),
    ("Test it", "tests for GET /items", 0.0),
]


async def bodies(daemon: Daemon, kind: str, run: str) -> list[Any]:
    found = await daemon.ledger.entries(start=0, limit=10_000, kind=kind, run=run)
    return [(await daemon.ledger.body(e.body)).value if e.body else None for e in found]


async def kinds(daemon: Daemon, run: str) -> list[str]:
    return [e.kind for e in await daemon.ledger.entries(start=0, limit=10_000, run=run)]
