"""The record's models against a corpus of real bodies main wrote (`corpus.jsonl`).

`corpus.jsonl` was recorded with main's code before the record had models (see
`tests/record/corpus.py`): what product code wrote during the engine, daemon, gateway, surface,
routing, agent and workspace tests, a few distinct bodies per kind and shape, each as its
canonical bytes; the kinds whose writers run only in subprocess daemons there (clients,
redaction, the unsandboxed policy, a failing or idle member's slot kinds) came later from
`tests/record/test_writers.py`, which runs those writers in process. Every body must fit its
kind's model and schema, and a writer building that model (`written()`) must give back exactly
those bytes: the canonical bytes of every kind stay what they were.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from jsonschema import Draft202012Validator

from daemon import record
from daemon.ledger.canonical import canonicalize

CORPUS = Path(__file__).with_name("corpus.jsonl")


def _corpus() -> list[dict[str, Any]]:
    return [json.loads(line) for line in CORPUS.read_text().splitlines() if line]


ITEMS = _corpus()


def _id(item: dict[str, Any]) -> str:
    return f"{item['kind']}@{item['where']}"


def test_the_corpus_is_broad() -> None:
    """It holds the kinds of every area, so the tests below hold each area's writers."""
    kinds = {item["kind"] for item in ITEMS}
    for kind in (
        "run.request", "run.route", "run.plan", "task.start", "model.call", "model.reply",
        "task.result", "task.verdict", "run.answer", "run.state", "command.run",
        "gateway.call", "gateway.reply", "slot.ready", "slot.stopped", "roster.reload",
        "workspace.snapshot", "task.diff", "agent.step", "route.teach", "gateway.fallback",
    ):  # fmt: skip
        assert kind in kinds, kind
    assert len(ITEMS) > 100


def test_every_kind_has_a_real_body_in_the_corpus() -> None:
    """A kind registered in `record.KINDS` with no line here has no writer held to its bytes:
    add one written by its real writer (`tests/record/test_writers.py` shows how for writers
    that otherwise run only in subprocess daemons)."""
    kinds = {item["kind"] for item in ITEMS}
    missing = sorted(model.KIND for model in record.KINDS if model.KIND not in kinds)
    assert missing == [], f"kinds with no body in {CORPUS.name}: {missing}"


@pytest.mark.parametrize("item", ITEMS, ids=_id)
def test_every_body_is_its_kind_byte_for_byte(item: dict[str, Any]) -> None:
    model = record.model_for(item["kind"])
    assert model is not None, f"{item['kind']} (written at {item['where']}) is not registered"
    body = None if item["body"] is None else json.loads(item["body"])
    assert body is not None, f"{item['kind']} has no body"
    built = model.read(body)
    assert canonicalize(built.written()).decode() == item["body"]
    actor = item["actor"]
    assert actor in model.ACTORS or (record.CLIENT in model.ACTORS and actor not in RESERVED)


RESERVED = {"engine", "daemon", "pool", "tool"}


@pytest.mark.parametrize("item", ITEMS, ids=_id)
def test_every_body_fits_the_published_schema(item: dict[str, Any]) -> None:
    validator = VALIDATORS[item["kind"]]
    errors = [e.message for e in validator.iter_errors(json.loads(item["body"]))]
    assert errors == []


VALIDATORS = {kind: Draft202012Validator(s) for kind, s in record.schemas().items()}


def test_the_schemas_are_valid_2020_12() -> None:
    for kind, schema in record.schemas().items():
        Draft202012Validator.check_schema(schema)
        assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema", kind


def test_a_body_that_does_not_fit_is_refused() -> None:
    """The checks above can fail: a missing field, a wrong type, an unknown field to write."""
    ok = {"state": "done", "error": None}
    assert record.read("run.state", ok) is not None
    validator = VALIDATORS["run.state"]
    with pytest.raises(ValueError):
        record.read("run.state", {"state": "done"})
    assert not validator.is_valid({"state": "done"})
    with pytest.raises(ValueError):
        record.read("run.state", {"state": 3, "error": None})
    assert not validator.is_valid({"state": 3, "error": None})
    later = record.read("run.state", ok | {"added_later": 1})  # read: tolerant
    assert later is not None
    with pytest.raises(TypeError, match="added_later"):
        later.written()  # write: strict
    assert record.read("no.such.kind", ok) is None
