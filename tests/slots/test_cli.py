"""`tally slots --roster FILE` starts the pool in-process and prints its status."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from daemon.slots.process import free_port
from surfaces.cli import main

ROSTER = """
version = 1
[[models]]
name = "fake"
command = ["{python}", "-m", "tests.slots.fake_server", "--port", "{port}", "--slots", "{slots}"]
slots = 2
[tiers]
ladder = ["cheap"]
cheap = ["fake"]
[[lanes]]
name = "x"
keywords = ["x"]
tier = "cheap"
system = "s"
"""


def test_slots_smoke_check_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    roster = tmp_path / "roster.toml"
    roster.write_text(ROSTER)
    assert main(["slots", "--roster", str(roster), "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    member = status["members"][0]
    assert member["state"] == "ready"
    assert member["instances"][0]["slots_total"] == 2


def test_slots_table_and_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    roster = tmp_path / "roster.toml"
    roster.write_text(ROSTER)
    assert main(["slots", "--roster", str(roster)]) == 0
    assert "fake" in capsys.readouterr().out
    roster.write_text(ROSTER.replace('"{slots}"]', '"{slots}", "--die-on-start"]'))
    assert main(["slots", "--roster", str(roster), "--timeout", "20"]) == 1
    assert "cooling down" in capsys.readouterr().err
    assert main(["slots", "--roster", str(tmp_path / "missing.toml")]) == 2


def test_slots_names_a_member_that_is_down_at_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    roster = tmp_path / "roster.toml"
    port = free_port()
    gone = f'\n[[models]]\nname = "gone"\nurl = "http://127.0.0.1:{port}/v1"\n'
    text = ROSTER.replace("[tiers]", gone + "[tiers]").replace('["fake"]', '["fake", "gone"]')
    roster.write_text(text)
    started = time.monotonic()
    assert main(["slots", "--roster", str(roster)]) == 1
    assert time.monotonic() - started < 15  # not the 120 s ready timeout
    out, err = capsys.readouterr()
    assert "gone" in out
    assert "unhealthy" in out
    assert f"gone: member 'gone' is unreachable: cannot connect to http://127.0.0.1:{port}" in err
