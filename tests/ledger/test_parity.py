"""The engine tests' in-memory ledger refuses exactly what the real ledger refuses."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from daemon.errors import InvalidInput
from daemon.ledger import Ledger
from tests.runs.fakes import MemoryLedger

BAD: list[tuple[str, dict[str, Any]]] = [
    ("a float", {"body": {"x": 1.5}}),
    ("an integer past 2^53", {"body": {"n": 2**53}}),
    ("a negative integer past 2^53", {"body": [-(2**53)]}),
    ("a lone surrogate in a body", {"body": {"text": "\ud800"}}),
    ("a lone surrogate in the actor", {"actor": "a\udfff"}),
    ("a lone surrogate in the run", {"run": "r\ud800"}),
    ("an empty actor", {"actor": ""}),
    ("an empty kind", {"kind": ""}),
    ("a parent that is not a seq yet", {"parent": 5}),
    ("a negative parent", {"parent": -1}),
    ("a bool parent", {"parent": True}),
    ("a non-string key", {"body": {1: "x"}}),
    ("NaN", {"body": float("nan")}),
]
GOOD: list[tuple[str, dict[str, Any]]] = [
    ("the largest safe integer", {"body": {"n": 2**53 - 1}}),
    ("non-ASCII text", {"body": {"text": "héllo ✓ 𝄞"}, "actor": "ünïcode"}),
    ("an existing parent", {"parent": 0}),
    ("no body", {}),
]


@pytest.fixture(params=["real", "memory"])
async def ledger(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Any]:
    if request.param == "real":
        real = await Ledger.open(tmp_path, checkpoint_interval=None)
        await real.append(actor="t", kind="first")
        yield real
        await real.close()
    else:
        memory = MemoryLedger()
        await memory.append(actor="t", kind="first")
        yield memory


@pytest.mark.parametrize(("what", "change"), BAD, ids=[b[0] for b in BAD])
async def test_both_refuse(ledger: Any, what: str, change: dict[str, Any]) -> None:
    with pytest.raises(InvalidInput):
        await ledger.append(**({"actor": "a", "kind": "k"} | change))
    assert ledger.size == 1


@pytest.mark.parametrize(("what", "change"), GOOD, ids=[g[0] for g in GOOD])
async def test_both_accept(ledger: Any, what: str, change: dict[str, Any]) -> None:
    entry = await ledger.append(**({"actor": "a", "kind": "k"} | change))
    assert entry.seq == 1
    if change.get("body") is not None:
        assert (await ledger.body(entry.body)).value == change["body"]
