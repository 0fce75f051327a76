"""The console's body check (surfaces/console/static/schema.js), run in Node, agrees with the
Python validator on the published schemas: every real body of the corpus fits its kind, and
each broken one fails in both."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft202012Validator

from daemon import record

ROOT = Path(__file__).resolve().parents[2]
NODE = shutil.which("node")
CORPUS = ROOT / "tests/record/corpus.jsonl"
pytestmark = pytest.mark.skipif(NODE is None, reason="node is not installed")


def _node(document: dict[str, Any], bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    done = subprocess.run(
        [NODE or "node", str(ROOT / "tests/console/schema_node.mjs")],
        input=json.dumps({"document": document, "bodies": bodies}),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return list(json.loads(done.stdout))


def test_the_console_and_python_agree_on_every_body() -> None:
    document = record.document()
    corpus = [json.loads(line) for line in CORPUS.read_text().splitlines()]
    bodies = [{"kind": c["kind"], "body": json.loads(c["body"])} for c in corpus]
    reply = next(b["body"] for b in bodies if b["kind"] == "gateway.reply")
    step = next(b["body"] for b in bodies if b["kind"] == "agent.step")
    broken = [
        {"kind": "run.state", "body": {"state": "done"}},
        {"kind": "run.cancel", "body": {"reason": 7}},
        {"kind": "gateway.reply", "body": reply | {"usage": {"prompt_tokens": "1"}}},
        {"kind": "agent.step", "body": step | {"mode": "telepathy"}},
        {"kind": "task.start", "body": {"task": "t", "attempt": 1.5}},
        {"kind": "run.request", "body": []},
    ]
    later = {"kind": "run.state", "body": {"state": "done", "error": None, "added_later": 1}}
    got = _node(document, [*bodies, *broken, later])
    for item, verdict in zip([*bodies, *broken, later], got, strict=True):
        validator = Draft202012Validator(document["schemas"][item["kind"]])
        assert verdict["ok"] is validator.is_valid(item["body"]), (item, verdict)
    assert all(v["ok"] for v in got[: len(bodies)])
    assert not any(v["ok"] for v in got[len(bodies) : -1])
    assert got[-1]["ok"] is True  # reading is tolerant of fields a later tally adds
    assert "error is missing" in got[len(bodies)]["detail"]
    assert "$.reason: is integer, not string" in got[len(bodies) + 1]["detail"]


def test_a_kind_tally_does_not_write_is_not_judged() -> None:
    (verdict,) = _node(record.document(), [{"kind": "note", "body": {"i": 1}}])
    assert verdict == {"ok": None, "detail": "note is not a kind tally writes"}
