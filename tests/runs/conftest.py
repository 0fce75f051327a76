"""Fixtures for the runs tests: a real Daemon against the scripted fake model server."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from daemon.config import Settings
from daemon.service import Daemon
from tests.runs.model_server import Reply, ScriptedServer, roster_toml

Factory = Callable[..., Any]


@pytest.fixture
async def fleet(tmp_path: Path) -> AsyncIterator[Factory]:
    """fleet(rules, **settings) -> (daemon, server), both stopped after the test."""
    made: list[tuple[Daemon, ScriptedServer]] = []

    async def make(
        rules: list[tuple[str, Reply, float]],
        policy: dict[str, Any] | None = None,
        sampling: str = "",
        **over: Any,
    ) -> tuple[Daemon, ScriptedServer]:
        server = ScriptedServer(rules, default="done")
        await server.start()
        roster = tmp_path / "roster.toml"
        roster.write_text(roster_toml(server.url, sampling, **(policy or {})))
        settings = Settings.from_env(
            state_dir=tmp_path / "state",
            runtime_dir=tmp_path / "run",
            roster_path=roster,
            checkpoint_interval_s=3600,
            drain_s=0.2,
            **over,
        )
        daemon = Daemon(settings)
        await daemon.start()
        made.append((daemon, server))
        return daemon, server

    yield make
    for daemon, server in made:
        await daemon.stop()
        await server.stop()
