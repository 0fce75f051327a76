"""The replay reducer reads typed bodies: the engine's model as witnessed, a stored body as its
kind's model; an absent body (redacted) or one that does not fit its kind (old or hostile)
counts only for what its kind says, and is never read field by field."""

from __future__ import annotations

import importlib
import logging
from typing import Any

import pytest

from daemon import record as rec
from daemon.runs.replay import apply
from daemon.runs.state import RunView

RUN = "r0123456789abcde"
REPLAY = importlib.import_module("daemon.runs.replay")  # the package exports a function so named


def request(**over: Any) -> dict[str, Any]:
    body = rec.RunRequest(
        request="write the docs",
        lane="docs",
        plan=None,
        budget=rec.Budget(model_calls=4, tokens=1000, wall_ms=None),
        max_parallel=None,
        barrier=False,
        idempotency_key=None,
        client="ci",
    ).written()
    return body | over


def plan() -> dict[str, Any]:
    tasks = [{"id": "T1", "lane": "docs", "instruction": "x", "needs": []}]
    return {"source": "client", "plan": {"tasks": tasks}, "waves": [["T1"]],
            "critical_path": 1, "error": None}  # fmt: skip


def started(*entries: tuple[str, object]) -> RunView:
    views: dict[str, RunView] = {}
    apply(views, 0, 1_000, "run.request", RUN, request())
    apply(views, 1, 2_000, "run.plan", RUN, plan())
    for seq, (kind, body) in enumerate(entries, start=2):
        apply(views, seq, 1_000 * (seq + 1), kind, RUN, body)
    return views[RUN]


def test_stored_bodies_and_the_engines_models_reduce_alike() -> None:
    call = {"purpose": "task", "task": "T1", "target": "cheap", "member": "tiny", "instance": 0,
            "slot": 1, "request": {"messages": []}}  # fmt: skip
    state = {"state": "done", "error": None}
    stored = started(("model.call", call), ("run.state", state))
    typed = started(
        ("model.call", rec.ModelCall.read(call)), ("run.state", rec.RunState.read(state))
    )
    assert stored == typed
    assert stored.state == "done"
    assert stored.tasks[0].member == "tiny"
    assert stored.spent.model_calls == 1
    assert stored.budget.model_calls == 4
    assert stored.client == "ci"


def test_fields_a_later_tally_added_are_read_past() -> None:
    view = started(("run.state", {"state": "failed", "error": "x", "added_later": [1]}))
    assert (view.state, view.error) == ("failed", "x")


def test_a_redacted_request_still_opens_the_run() -> None:
    views: dict[str, RunView] = {}
    apply(views, 0, 1_000, "run.request", RUN, None)
    assert views[RUN].request == ""
    assert views[RUN].state == "queued"
    assert views[RUN].budget.model_calls is None


@pytest.mark.parametrize(
    "body",
    [
        None,  # redacted
        {"state": 3, "error": None},  # not its kind's type
        {"state": "done"},  # a field missing
        {"state": "asleep", "error": None},  # no state a run has
        "done",  # not an object at all
    ],
)
def test_a_final_state_the_record_cannot_say_is_not_guessed(
    body: object, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="daemon.runs.replay"):
        view = started(("run.state", body))
    assert view.state == "running"  # what the plan made it; replay went on
    assert view.error is None


def test_a_misfit_counts_for_its_kind_only_and_is_logged(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(REPLAY, "_misfit_kinds", set())  # logged once per kind per process
    hostile = {"purpose": "task", "task": ["T1"], "member": 7}  # wrong types, missing fields
    with caplog.at_level(logging.WARNING, logger="daemon.runs.replay"):
        view = started(("model.call", hostile), ("model.reply", {"usage": "lots"}))
    assert view.spent.model_calls == 1  # a model call was witnessed
    assert view.spent.tokens == 0  # nothing read from a usage that is not one
    assert view.tasks[0].member is None
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "model.call" in said
    assert "model.reply" in said


def test_a_model_of_another_kind_is_not_read_as_this_one() -> None:
    wrong = rec.RunState(state="done", error=None)
    view = started(("run.answer", wrong))
    assert view.answer is None
    assert view.state == "running"
