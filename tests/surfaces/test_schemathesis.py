"""Schemathesis (the CLI, every check on) against `/openapi.json` of a throwaway daemon over TCP
with an admin token: the server must do exactly what its document says, 0 failures.

Only the SSE events stream is left out (a stream never ends, so no check can read it whole).
State-changing tools (redaction, roster reload, cancel) run too: the daemon is thrown away.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from daemon.service import Daemon
from surfaces.http import HttpOptions, app_runner, create_app
from tests.slots.fake_server import FakeServer
from tests.surfaces.conftest import daemon_settings

TOKEN = "schemathesis-admin"
SCHEMATHESIS = Path(sys.executable).with_name("schemathesis")
CONFIG = Path(__file__).with_name("schemathesis.toml")

pytestmark = pytest.mark.skipif(not SCHEMATHESIS.exists(), reason="`make install` (dev extra)")


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The real app over the real daemon, on its own loop in a thread, over loopback TCP."""
    tmp: Path = tmp_path_factory.mktemp("schemathesis")
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    holder: dict[str, Any] = {}

    async def start() -> None:
        model = FakeServer(slots=4)
        await model.start()
        daemon = Daemon(daemon_settings(tmp, model.url))
        await daemon.start()
        options = HttpOptions(token=TOKEN)
        runner = app_runner(create_app(daemon, options), options)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        holder.update(runner=runner, port=runner.addresses[0][1], daemon=daemon, model=model)

    async def stop() -> None:
        await holder["runner"].cleanup()
        await holder["daemon"].stop()
        await holder["model"].stop()

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(start())
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert ready.wait(30)
    yield f"http://127.0.0.1:{holder['port']}"
    asyncio.run_coroutine_threadsafe(stop(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def test_schemathesis_every_check_zero_failures(base_url: str, tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    argv = [
        str(SCHEMATHESIS),
        "--config-file",
        str(CONFIG),
        "run",
        f"{base_url}/openapi.json",
        "--checks",
        "all",
        "--header",
        f"Authorization: Bearer {TOKEN}",
        "--exclude-path-regex",
        "/events$",
        "--max-examples",
        "8",
        "--max-failures",
        "50",
        "--request-timeout",
        "10",
        "--seed",
        "1",
        "--workers",
        "1",
        "--no-color",
        "--report",
        "json",
        "--report-json-path",
        str(report),
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("TALLY_")}
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, check=False)
    Path("/tmp/strict_st_out.txt").write_text(proc.stdout + proc.stderr)
    assert proc.returncode == 0, proc.stdout[-20000:] + proc.stderr[-5000:]
    assert json.loads(report.read_text()) is not None
