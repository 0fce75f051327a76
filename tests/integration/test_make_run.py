"""`make run`'s path for real: `tally serve` on the packaged default roster (the embedded
SmolLM2 pool), one `tally submit --json` over the socket, SIGTERM, `tally ledger verify`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.integration.processes import ROOT, TALLY, alive

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _tally(
    *args: str, env: dict[str, str], timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(TALLY), *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.mark.skipif(not TALLY.exists(), reason="run `make install` for the tally command")
def test_serve_submit_sigterm_verify(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "TALLY_STATE_DIR": str(tmp_path / "state"),
        "TALLY_RUNTIME_DIR": str(tmp_path / "run"),
    }
    for name in ("TALLY_SOCKET", "TALLY_URL", "TALLY_TCP", "TALLY_ROSTER", "NOTIFY_SOCKET"):
        env.pop(name, None)
    socket_path = tmp_path / "run" / "tally.sock"
    log = (tmp_path / "serve.log").open("w")
    serve = subprocess.Popen([str(TALLY), "serve"], env=env, cwd=ROOT, stderr=log, stdout=log)
    try:
        deadline = time.monotonic() + 60
        while not socket_path.exists():
            assert serve.poll() is None, (tmp_path / "serve.log").read_text()
            assert time.monotonic() < deadline, "the daemon did not listen within 60 s"
            time.sleep(0.1)
        # what `make run` shows its user: where it listens and the IDE's MCP block
        deadline = time.monotonic() + 10
        while "mcpServers" not in (tmp_path / "serve.log").read_text():
            assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
            time.sleep(0.1)
        shown = (tmp_path / "serve.log").read_text()
        assert f"listening on unix:{socket_path}" in shown
        assert '"mcpServers"' in shown
        assert '"mcp"' in shown

        done = _tally(
            "submit",
            "--json",
            "--lane",
            "docs",
            "Write a one-line docstring for a function that adds two numbers.",
            env=env,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr
        run = json.loads(done.stdout)
        assert run["state"] == "done", run
        assert run["answer"].strip()

        slots = _tally("slots", "--json", env=env)
        assert slots.returncode == 0, slots.stderr
        pids = [
            i["pid"]
            for m in json.loads(slots.stdout)["members"]
            for i in m["instances"]
            if i["pid"]
        ]
        assert pids, "the model server should be running after a request"

        serve.send_signal(signal.SIGTERM)
        assert serve.wait(60) == 0, (tmp_path / "serve.log").read_text()
        deadline = time.monotonic() + 10
        while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(pid) for pid in pids), "a model server outlived the daemon"
        assert not socket_path.exists()
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
        log.close()

    verify = _tally("ledger", "verify", "--deep", env=env)
    assert verify.returncode == 0, verify.stdout + verify.stderr
