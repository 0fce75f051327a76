"""The watch `tests/conftest.py` keeps on every test: product code writes only registered
kinds, each exactly its model."""

from __future__ import annotations

import pytest

from daemon import record
from daemon.ledger.canonical import canonicalize
from daemon.runs.engine import Engine
from tests.record.corpus import Watch, Written, misfits, watching
from tests.runs.fakes import KeywordRouter, MemoryLedger, ScriptedPool, make_roster


def _written(kind: str, body: object, where: str = "daemon/x.py:1") -> Written:
    text = None if body is None else canonicalize(body).decode()
    return Written(kind=kind, actor="engine", body=text, where=where)


def test_an_unregistered_kind_is_named_with_where_it_was_written() -> None:
    watch = Watch([_written("tool.unheard", {"member": "m"}, "daemon/runs/unheard.py:7")])
    (found,) = misfits(watch)
    assert "daemon/runs/unheard.py:7" in found
    assert "'tool.unheard'" in found


def test_a_body_that_is_not_its_model_is_named() -> None:
    extra = _written("run.state", {"state": "done", "error": None, "new_field": 1})
    missing = _written("run.state", {"state": "done"})
    wrong = _written("run.cancel", {"reason": 5})
    found = misfits(Watch([extra, missing, wrong]))
    assert len(found) == 3
    assert "new_field" in found[0]
    assert "RunState" in found[1]
    assert "RunCancel" in found[2]
    assert misfits(Watch([_written("run.state", {"state": "done", "error": None})])) == []


def test_a_parent_of_another_kind_is_named() -> None:
    wrong = _written("run.state", {"state": "done", "error": None})
    wrong.parent = "model.call"
    (found,) = misfits(Watch([wrong]))
    assert "hangs off a model.call" in found


def test_every_kind_is_registered_once_with_its_actors_and_parents() -> None:
    assert len({m.KIND for m in record.KINDS}) == len(record.KINDS)
    known = {m.KIND for m in record.KINDS}
    for model in record.KINDS:
        assert model.ACTORS, model.KIND
        assert set(model.PARENTS) <= known, (model.KIND, set(model.PARENTS) - known)
        assert set(model.model_fields) >= model.OPTIONAL, model.KIND


async def test_the_watch_sees_what_the_engine_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A real run's entries are seen as product writes, each with the line that wrote it."""
    watch = watching(monkeypatch)
    roster = make_roster()
    ledger = MemoryLedger()
    engine = Engine(ledger, ScriptedPool(roster, lambda m, msgs: "an answer"), roster,
                    KeywordRouter(roster))  # fmt: skip
    await ledger.append(actor="test", kind="test.own", body={"a": 1})  # a test's own: not seen
    view = await engine.wait((await engine.submit("backend api")).id, timeout=5)
    assert view.state == "done"
    kinds = [w.kind for w in watch.written]
    assert kinds[0] == "run.request"
    assert kinds[-1] == "run.state"
    assert "test.own" not in kinds
    assert all(w.where.startswith("daemon/runs/") for w in watch.written)
    parents = {(w.kind, w.parent) for w in watch.written if w.parent is not None}
    assert ("run.route", "run.request") in parents  # the in-memory ledger names each parent
    assert misfits(watch) == []


def test_the_engine_s_kind_names_are_the_record_s() -> None:
    from daemon import gateway
    from daemon.runs import entries as k
    from daemon.workspace import record as ws

    for kind in (*k.KINDS, *ws.KINDS, *gateway.KINDS, gateway.LIMITED):
        assert record.model_for(kind) is not None, kind


def test_a_reader_counts_what_fits_and_skips_the_rest() -> None:
    ok = {"task": "t", "attempt": 1, "ok": True, "failures": [], "judge": None, "next": "done"}
    verdict = record.TaskVerdict.parsed(ok)
    assert verdict is not None
    assert verdict.ok is True
    assert record.TaskVerdict.parsed(ok | {"ok": "yes"}) is None
    assert record.TaskVerdict.parsed(["not", "a", "body"]) is None


def test_every_body_model_anywhere_is_registered() -> None:
    """A kind's model declared anywhere in the product (say by a branch that adds one) is in
    `daemon.record.KINDS`, so every surface publishes it."""
    import importlib
    import pkgutil

    import daemon

    for info in pkgutil.walk_packages(daemon.__path__, "daemon."):
        if not info.name.endswith("packscan"):  # a script run as `python -I -S`, not imported
            importlib.import_module(info.name)
    seen: list[type[record.Body]] = []
    todo: list[type[record.Body]] = [record.Body]
    while todo:
        for sub in todo.pop().__subclasses__():
            seen.append(sub)
            todo.append(sub)
    declared = {model for model in seen if "KIND" in vars(model)}
    assert declared - set(record.KINDS) == set()
