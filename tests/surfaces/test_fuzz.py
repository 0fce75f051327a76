"""Schemathesis (its CLI, every check on) against `/openapi.json` of a throwaway daemon over
TCP with the legacy `http.token` (every scope): the server does exactly what its document says,
0 failures; then the ledger still verifies, bodies included.

Only the SSE events stream is left out (a stream never ends, so no check can read it whole).
State-changing tools (redaction, roster reload, cancel) run too: the daemon is thrown away.
What schemathesis.toml allows beyond the defaults, and why, is written there. The run is
bounded: a fixed seed, 8 examples per operation and phase, 10 s per request (about 15 s).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from daemon.service import Daemon
from daemon.tools import TOOLS
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
        # The events stream never ends; the gateway's operations are OpenAI's, driven by the
        # official SDK in test_gateway*.py (fuzzing them spends a model call per example).
        "--exclude-path-regex",
        "/events$|^/v1/(models|chat/completions|embeddings)$",
        "--max-examples",
        "8",
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
    proc = subprocess.run(
        argv, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path, check=False
    )
    assert proc.returncode == 0, proc.stdout[-20000:] + proc.stderr[-5000:]
    result = json.loads(report.read_text())
    assert result["complete"] is True
    assert result["failures"] == []
    assert result["errors"] == []
    # The tools, plus the other operations but the events stream (the tool list, metrics,
    # healthz and the record's schema).
    assert result["operations"]["tested"] == len(TOOLS) + 4
    assert result["test_cases"]["generated"] > 10 * len(TOOLS)
    verify = post(base_url, "/v1/tools/ledger_verify", {"deep": True})
    assert verify["ok"] is True, verify


def post(base_url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        base_url + path,
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as resp:
        answer: dict[str, Any] = json.loads(resp.read())
    return answer
