"""`tally roster check | show | lanes`: output and exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from roster import load_roster_text
from surfaces.cli import main
from tests.roster.conftest import GOOD


@pytest.fixture
def good(tmp_path: Path) -> Path:
    path = tmp_path / "roster.toml"
    path.write_text(GOOD)
    return path


@pytest.fixture
def bad(tmp_path: Path) -> Path:
    path = tmp_path / "bad.toml"
    path.write_text(
        GOOD.replace('tier = "cheap"', 'tier = "capabel"').replace("slots = 2", "slots = 0")
    )
    return path


def test_check_ok(good: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["roster", "check", str(good)]) == 0
    assert capsys.readouterr().out == "ok: 2 lanes, 2 tiers, 2 members\n"


def test_check_counts_are_pluralized(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    one = """
[[models]]
name = "m"
url = "http://127.0.0.1:1/v1"
[tiers]
ladder = ["t"]
t = ["m"]
[[lanes]]
name = "x"
keywords = ["x"]
tier = "t"
system = "s"
"""
    path = tmp_path / "one.toml"
    path.write_text(one)
    assert main(["roster", "check", str(path)]) == 0
    assert capsys.readouterr().out == "ok: 1 lane, 1 tier, 1 member\n"
    assert main(["roster", "check", "--json", str(path)]) == 0
    counts = json.loads(capsys.readouterr().out)
    assert (counts["lanes"], counts["tiers"], counts["members"]) == (1, 1, 1)


def test_check_prints_every_located_error(bad: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["roster", "check", str(bad)]) == 1
    assert capsys.readouterr().out.splitlines() == [
        f"{bad}:11:9 models[0].slots: Input should be greater than or equal to 1 (got 0)",
        f"{bad}:28:8 lanes[0].tier: unknown tier 'capabel' (known: cheap, capable)",
    ]


def test_check_json(bad: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["roster", "check", "--json", str(bad)]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] is False
    assert [e["field"] for e in out["errors"]] == ["models[0].slots", "lanes[0].tier"]


def test_check_defaults_to_tally_roster(
    good: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TALLY_ROSTER", str(good))
    assert main(["roster", "check"]) == 0
    assert capsys.readouterr().out.startswith("ok: 2 lanes")


def test_show_json_and_toml(good: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["roster", "show", "--json", "--roster", str(good)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["tiers"] == {"ladder": ["cheap", "capable"], "cheap": ["tiny"], "capable": ["big"]}
    assert main(["roster", "show", "--roster", str(good)]) == 0
    assert load_roster_text(capsys.readouterr().out) == load_roster_text(GOOD)


def test_lanes_table(good: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["roster", "lanes", "--roster", str(good)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["lane", "tier", "keywords", "first", "keywords"]
    assert lines[1].split() == ["backend", "cheap", "3", "api,", "server,", "endpoint"]
    assert lines[2].split()[:3] == ["frontend", "capable", "3"]
    assert main(["roster", "lanes", "--roster", str(good), "--json"]) == 0
    lanes = json.loads(capsys.readouterr().out)
    assert [(lane["name"], lane["tier"]) for lane in lanes] == [
        ("backend", "cheap"),
        ("frontend", "capable"),
    ]
    assert lanes[0]["keywords"] == ["api", "server", "endpoint"]


def test_version_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["version", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["version"]


def test_show_bad_roster_exits_1_without_traceback(bad: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "surfaces", "roster", "show", "--roster", str(bad)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 1
    assert "Traceback" not in out.stderr
    assert "lanes[0].tier: unknown tier 'capabel'" in out.stderr


def test_usage_error_exits_2() -> None:
    with pytest.raises(SystemExit) as caught:
        main(["roster", "frobnicate"])
    assert caught.value.code == 2


@pytest.mark.parametrize(
    "argv",
    [
        ["roster", "check", "{file}"],
        ["roster", "show", "--roster", "{file}"],
        ["roster", "lanes", "--roster", "{file}"],
        ["route", "--roster", "{file}", "x"],
        ["plan", "--roster", "{file}", "{plan}"],
        ["slots", "--roster", "{file}"],
    ],
)
def test_toml_syntax_errors_are_located_like_the_others(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    path = tmp_path / "broken.toml"
    path.write_text(GOOD.replace("slots = 2", "slots = "))
    plan = tmp_path / "plan.json"
    plan.write_text('{"tasks": []}')
    code = main([a.format(file=path, plan=plan) for a in argv])
    assert code in (1, 2)
    captured = capsys.readouterr()
    lines = (captured.out + captured.err).splitlines()
    assert f"{path}:11:9 models[0].slots: TOML syntax: Invalid value" in lines
    assert "(at line" not in captured.out + captured.err


@pytest.mark.parametrize(
    "text",
    ["a = " + "[" * 5000 + "]" * 5000, "x = {" + "a = {" * 3000 + "}" * 3000 + "}"],
)
def test_a_roster_nested_past_the_parsers_limit_is_named_not_a_crash(
    tmp_path: Path, text: str
) -> None:
    from roster.loading import RosterError, load_roster_text

    with pytest.raises(RosterError, match=r"deep\.toml: arrays or inline tables nest too deep"):
        load_roster_text(text, "deep.toml")
