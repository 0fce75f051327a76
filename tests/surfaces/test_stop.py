"""Ctrl-C on `tally serve` with a run in flight: it says what it does, drains within its bound,
and leaves the run interrupted (resumable). The model server is the fake llama-server,
spawned by the daemon from the roster and slowed so the run is still going at the signal."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TALLY = Path(sys.executable).with_name("tally")

ROSTER = """version = 1
[[models]]
name = "slow"
command = ["{python}", "-m", "tests.slots.fake_server", "--port", "{port}", "--slots", "{slots}",
           "--token-delay", "0.05"]
slots = 2

[tiers]
ladder = ["cheap"]
cheap = ["slow"]

[[lanes]]
name = "backend"
keywords = ["api"]
tier = "cheap"
system = "You write backend code."
"""


def _tally(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(TALLY), *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=60
    )


@pytest.mark.skipif(not TALLY.exists(), reason="run `make install` for the tally command")
def test_ctrl_c_says_it_drains_then_interrupts_within_the_bound(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TALLY_")}
    env.pop("NOTIFY_SOCKET", None)
    env["TALLY_SOCKET"] = str(tmp_path / "tally.sock")
    roster = tmp_path / "roster.toml"
    roster.write_text(ROSTER)
    state = tmp_path / "state"
    argv = [str(TALLY), "serve", "--state", str(state), "--roster", str(roster)]
    log_path = tmp_path / "serve.log"
    with log_path.open("w") as log:
        serve = subprocess.Popen(argv, env=env, cwd=ROOT, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "tally.sock").exists():
            assert serve.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.05)
        submitted = _tally("submit", "--detach", "--lane", "backend", "the api", env=env)
        assert submitted.returncode == 0, submitted.stderr
        run_id = submitted.stdout.strip()
        deadline = time.monotonic() + 30
        while json.loads(_tally("run", run_id, "--json", env=env).stdout)["state"] != "running":
            assert time.monotonic() < deadline
            time.sleep(0.1)
        stopped_at = time.monotonic()
        serve.send_signal(signal.SIGINT)
        assert serve.wait(30) == 0, log_path.read_text()
        took = time.monotonic() - stopped_at
    finally:
        if serve.poll() is None:
            serve.kill()
    text = log_path.read_text()
    assert "stopping: draining 1 run… (up to 5 s;" in text
    assert took < 5 + 5, f"the stop took {took:.1f} s with a 5 s drain"
    verify = _tally("ledger", "verify", "--state", str(state), "--json", env=env)
    assert json.loads(verify.stdout)["ok"] is True
    shown = _tally("ledger", "show", "--state", str(state), "--kind", "run.interrupted",
                   "--json", env=env)  # fmt: skip
    assert run_id in shown.stdout
