"""`tally route`: text and JSON output, stdin mode, bad rosters."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from surfaces.cli import main


def test_route_text(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["route", "write pytest unit tests for the parser"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("decision:   testing\nroute:      decided, confidence ")
    assert "unit test" in out


def test_route_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["route", "--json", "translate this paragraph into Spanish"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data) == {
        "lane",
        "confidence",
        "escalate",
        "scores",
        "matched",
        "similar",
        "examples",
        "decision",
        "embedding",
    }
    assert data["decision"]["lane"] == "translation"
    assert data["decision"]["source"] == "router"
    assert data["lane"] == "translation"
    assert data["escalate"] is False
    assert data["scores"][0][0] == "translation"
    assert "spanish" in data["matched"]["translation"]


def test_route_stdin_one_object_per_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    lines = "summarize this article\n\nwhat's a good pasta recipe\nshader for water\n"
    monkeypatch.setattr("sys.stdin", io.StringIO(lines))
    assert main(["route", "--json", "-"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    # one output line per input line, the blank one included, so a script can zip them
    assert [row["lane"] for row in rows] == ["summarization", None, None, "graphics"]
    assert [row["decision"]["lane"] for row in rows] == [
        "summarization",
        "general",
        "general",
        "graphics",
    ]
    assert rows[1] == {
        "lane": None,
        "confidence": 0.0,
        "escalate": True,
        "scores": [],
        "matched": {},
        "similar": {},
        "examples": {},
        "decision": {
            "lane": "general",
            "source": "general",
            "model_call": False,
            "classifier": None,
            "candidates": [],
            "summary": "general (no lane's words or examples match it enough: no model call)",
        },
        "embedding": None,
    }


def test_route_escalation_text(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["route", "what rhymes with orange"]) == 0
    out = capsys.readouterr().out
    # what submit does, not "a classifier would decide": no classifier runs on this roster
    summary = "general (no lane's words or examples match it enough: no model call)"
    assert out.startswith(f"decision:   {summary}")
    assert "classifier" not in out


def test_route_other_roster(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "r.toml"
    path.write_text(PASTA, encoding="utf-8")
    assert main(["route", "--json", "--roster", str(path), "a good pasta recipe"]) == 0
    assert json.loads(capsys.readouterr().out)["lane"] == "pasta"


def test_route_bad_roster(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("version = [\n", encoding="utf-8")
    assert main(["route", "--roster", str(path), "x"]) == 2
    assert main(["route", "--roster", str(tmp_path / "missing.toml"), "x"]) == 2
    err = capsys.readouterr().err
    assert "cannot load the roster" in err
    assert "Traceback" not in err


PASTA = """
[[models]]
name = "m"
url = "http://127.0.0.1:1/v1"
[tiers]
ladder = ["t"]
t = ["m"]
[[lanes]]
name = "pasta"
keywords = ["pasta", "recipe"]
tier = "t"
system = "You cook."
"""


def test_route_defaults_to_tally_roster(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "env.toml"
    path.write_text(PASTA, encoding="utf-8")
    monkeypatch.setenv("TALLY_ROSTER", str(path))
    assert main(["route", "--json", "a good pasta recipe"]) == 0
    assert json.loads(capsys.readouterr().out)["lane"] == "pasta"
    monkeypatch.setenv("TALLY_ROSTER", str(tmp_path / "missing.toml"))
    assert main(["route", "x"]) == 2
    assert "missing.toml" in capsys.readouterr().err
    # --roster still wins over the environment
    assert main(["route", "--json", "--roster", str(path), "a good pasta recipe"]) == 0


def test_route_json_is_the_route_tool_answer(capsys: pytest.CaptureFixture[str]) -> None:
    """`tally route --json` and the `route` tool give the same fields and decision."""
    from daemon.router import Router
    from daemon.tools.roster import route_out
    from surfaces.cli.route import read_roster

    text = "write a changelog entry for the new export button"
    assert main(["route", "--json", text]) == 0
    cli = json.loads(capsys.readouterr().out)
    tool = route_out(Router(read_roster()).route(text)).model_dump(mode="json")
    tool["scores"] = [[s["lane"], s["score"]] for s in tool["scores"]]
    assert cli == tool
    assert cli["decision"]["lane"] == "docs"
