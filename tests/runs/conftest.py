"""Fixtures for the runs tests: a real Daemon against the scripted fake model server."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from daemon.service import Daemon
from tests.runs.model_server import Reply, ScriptedServer, roster_toml, settings_for

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
        roster = roster_toml(server.url, sampling, **(policy or {}))
        daemon = Daemon(settings_for(tmp_path, roster, **over))
        await daemon.start()
        made.append((daemon, server))
        return daemon, server

    yield make
    for daemon, server in made:
        await daemon.stop()
        await server.stop()
