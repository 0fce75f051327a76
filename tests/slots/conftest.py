"""Fixtures for the slot pool tests: rosters, a fast pool configuration, fake servers."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from daemon.slots import Pool, PoolOptions, SlotEvent
from roster import Lane, Member, Roster, Tiers
from tests.slots.fake_server import FakeServer

REPO = Path(__file__).resolve().parents[2]

FAST = PoolOptions(
    health_interval_s=0.1,
    health_timeout_s=0.3,
    health_failures=2,
    backoff_base_s=0.05,
    backoff_max_s=0.2,
    cooldown_after=3,
    failure_window_s=30,
    cooldown_s=0.6,
    probe_base_s=0.05,
    probe_max_s=0.2,
    ready_poll_s=0.02,
    stop_grace_s=2,
)


def roster_of(*members: Member, tiers: dict[str, list[str]] | None = None) -> Roster:
    tiers = tiers or {"t": [m.name for m in members]}
    lane = Lane(name="x", keywords=["x"], tier=next(iter(tiers)), system="s")
    return Roster(
        models=list(members), tiers=Tiers(ladder=list(tiers), members=tiers), lanes=[lane]
    )


def fake_command(*flags: str) -> list[str]:
    return [
        "{python}",
        "-m",
        "tests.slots.fake_server",
        "--port",
        "{port}",
        "--slots",
        "{slots}",
        "--ctx",
        "{ctx}",
        *flags,
    ]


def spawned(name: str = "fake", *flags: str, **kw: Any) -> Member:
    kw.setdefault("slots", 2)
    kw.setdefault("ctx", 512)
    kw.setdefault("ready_timeout_s", 10)
    return Member(name=name, command=fake_command(*flags), **kw)


MSG = [{"role": "user", "content": "say hello"}]


def single(url: str, name: str = "ext", **kw: Any) -> Member:
    """An external member (the server at `url`), one slot unless told."""
    kw.setdefault("slots", 1)
    return Member(name=name, url=url, **kw)


class Events(list[SlotEvent]):
    def __call__(self, event: SlotEvent) -> None:
        self.append(event)

    def kinds(self, member: str | None = None) -> list[str]:
        return [e.kind for e in self if member is None or e.member == member]


@pytest.fixture(autouse=True)
def _importable_tests(monkeypatch: pytest.MonkeyPatch) -> None:
    # spawned fake servers run `python -m tests.slots.fake_server` from the repository root
    monkeypatch.chdir(REPO)
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    )


@pytest.fixture
def events() -> Events:
    return Events()


PoolFactory = Callable[..., Pool]


@pytest.fixture
async def make_pool(state_dir: Path, events: Events) -> AsyncIterator[PoolFactory]:
    """make(*members, options=FAST, tiers=...) -> a Pool reporting to `events`, stopped after."""
    pools: list[Pool] = []

    def make(*members: Member, options: PoolOptions = FAST, **kw: Any) -> Pool:
        pool = Pool(roster_of(*members, **kw), state_dir, on_event=events, options=options)
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        await pool.stop()


@pytest.fixture
async def fake() -> AsyncIterator[FakeServer]:
    server = FakeServer(slots=4)
    await server.start()
    yield server
    await server.stop()
