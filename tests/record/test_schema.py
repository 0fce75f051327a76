"""The published vocabulary: `tally ledger schema`, `GET /v1/record/schema`, and
`tally ledger verify --deep` holding every body to its kind's schema (read-only)."""

from __future__ import annotations

import asyncio
import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from daemon import record
from daemon.ledger import Ledger
from surfaces.cli import main

CORPUS = Path(__file__).with_name("corpus.jsonl")


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().out


def test_the_cli_prints_every_kind_s_schema(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = run(capsys, "ledger", "schema")
    assert code == 0
    published = json.loads(out)
    assert published["dialect"] == "https://json-schema.org/draft/2020-12/schema"
    assert set(published["schemas"]) == {m.KIND for m in record.KINDS}
    assert set(published["kinds"]) == set(published["schemas"])
    assert published["kinds"]["gateway.reply"]["parents"] == ["gateway.call"]
    assert published["kinds"]["run.state"]["actors"] == ["engine"]
    assert published == json.loads(json.dumps(record.document()))


def _build(state_dir: Path, bodies: list[tuple[str, Any]]) -> None:
    async def go() -> None:
        ledger = await Ledger.open(state_dir, checkpoint_interval=None)
        for kind, body in bodies:
            await ledger.append(actor="engine", kind=kind, body=body)
        await ledger.close()

    asyncio.run(go())


def _files(state_dir: Path) -> dict[str, str]:
    return {
        str(p.relative_to(state_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(state_dir.rglob("*"))
        if p.is_file()
    }


def test_verify_deep_names_each_body_that_does_not_fit_by_seq(
    state_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = [json.loads(line) for line in CORPUS.read_text().splitlines()]
    real = [(item["kind"], json.loads(item["body"])) for item in corpus]
    bad = [
        ("run.state", {"state": "done"}),  # a field missing
        ("run.cancel", {"reason": 7}),  # a wrong type
        ("note", {"anything": 1}),  # not a kind of tally's: listed, not judged
    ]
    _build(state_dir, real + bad)
    before = _files(state_dir)
    code, out = run(capsys, "ledger", "verify", "--deep", "--state", str(state_dir))
    assert code == 1
    n = len(real)
    assert f"SCHEMA MISMATCH at seq {n} (run.state):" in out
    assert f"SCHEMA MISMATCH at seq {n + 1} (run.cancel):" in out
    assert "'error' is a required property" in out
    assert "7 is not of type 'string'" in out
    assert "unknown kinds (not tally's, not checked): note (1)" in out
    assert f"{n + 2} present bodies checked" in out
    code, out = run(capsys, "ledger", "verify", "--deep", "--json", "--state", str(state_dir))
    assert code == 1
    found = json.loads(out)["checked"]["schemas"]
    assert found["mismatches"] == 2
    assert [m["seq"] for m in found["first"]] == [n, n + 1]
    assert _files(state_dir) == before  # read-only: the record is as it was


def test_verify_deep_passes_a_ledger_of_real_bodies(
    state_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = [json.loads(line) for line in CORPUS.read_text().splitlines()]
    _build(state_dir, [(item["kind"], json.loads(item["body"])) for item in corpus])
    code, out = run(capsys, "ledger", "verify", "--deep", "--state", str(state_dir))
    assert code == 0, out
    assert f"{len(corpus)} present bodies checked against their kind's schema" in out
    assert ": 0 do not fit" in out
