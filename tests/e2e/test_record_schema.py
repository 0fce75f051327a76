"""Ajv (strict mode, JSON Schema 2020-12) compiles every kind's published schema and agrees
with tally on real bodies: each body of the corpus main wrote fits its kind's schema, and a
body missing a field or holding a wrong type does not."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from daemon import record

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests/e2e/ajv_strict.cjs"
AJV = ROOT / "tests/e2e/node_modules/ajv-formats"
CORPUS = ROOT / "tests/record/corpus.jsonl"

pytestmark = pytest.mark.skipif(
    not AJV.exists() or shutil.which("node") is None, reason="run `make install` for Ajv"
)


def _ajv(tmp_path: Path, schemas: dict[str, Any], instances: list[tuple[str, Any]]) -> Any:
    data = {
        "schemas": [{"label": kind, "schema": schema} for kind, schema in schemas.items()],
        "instances": [{"label": kind, "data": body} for kind, body in instances],
    }
    path = tmp_path / "input.json"
    path.write_text(json.dumps(data))
    done = subprocess.run(
        ["node", str(SCRIPT), str(path)],
        cwd=SCRIPT.parent,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(done.stdout)


def test_ajv_strict_compiles_every_kind_and_agrees_on_real_bodies(tmp_path: Path) -> None:
    published = record.document()
    assert published["dialect"] == "https://json-schema.org/draft/2020-12/schema"
    corpus = [json.loads(line) for line in CORPUS.read_text().splitlines()]
    real = [(item["kind"], json.loads(item["body"])) for item in corpus]
    wrong = [
        ("run.state", {"state": "done"}),
        ("run.cancel", {"reason": 7}),
        ("gateway.reply", {**_first(real, "gateway.reply"), "usage": {"prompt_tokens": "1"}}),
    ]
    found = _ajv(tmp_path, published["schemas"], real + wrong)
    assert found["errors"] == []
    verdicts = found["verdicts"]
    assert verdicts[: len(real)] == [True] * len(real)
    assert verdicts[len(real) :] == [False] * len(wrong)


def _first(bodies: list[tuple[str, Any]], kind: str) -> dict[str, Any]:
    return next(body for k, body in bodies if k == kind)
