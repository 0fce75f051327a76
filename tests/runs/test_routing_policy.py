"""How a run's lane is chosen when keyword routing is unsure, on the packaged default roster:
while `capable` is the embedded model the classifier does not run (the best-scoring lane, or
`general` when nothing matches, with no model call); pointed at a stronger member, it runs
and sees only the best-scoring few lanes and `general`."""

from __future__ import annotations

from typing import Any

from daemon.router import Router
from daemon.runs import entries as k
from daemon.runs.engine import Engine
from roster import Member
from roster.loading import default_roster_path, load_roster
from tests.runs.fakes import MemoryLedger, ScriptedPool


def _engine(script: Any, stronger: bool = False) -> tuple[Engine, MemoryLedger, ScriptedPool]:
    """The default roster; `stronger`: `capable` pointed at another member, as a user does."""
    roster = load_roster(default_roster_path())
    if stronger:
        big = Member(name="big", url="http://127.0.0.1:9/v1", model_id="big")
        tiers = roster.tiers.model_copy(
            update={"members": {**roster.tiers.members, "capable": ["big"]}}
        )
        roster = roster.model_copy(update={"models": [*roster.models, big], "tiers": tiers})
    ledger = MemoryLedger()
    pool = ScriptedPool(roster, script)
    return Engine(ledger, pool, roster, Router(roster)), ledger, pool


def _answer(member: str, messages: list[dict[str, Any]]) -> str:
    return "an answer"


async def test_an_off_topic_request_goes_to_general_without_a_routing_call() -> None:
    engine, ledger, _ = _engine(_answer)
    view = await engine.wait((await engine.submit("what should I cook for dinner")).id, 5)
    assert view.state == "done"
    assert view.lane == "general"
    [classified] = ledger.bodies_of(k.CLASSIFY, view.id)
    assert classified["source"] == "general"
    calls = ledger.bodies_of(k.MODEL_CALL, view.id)
    assert [c["purpose"] for c in calls] == ["task"]  # the answer's call; none to route


async def test_an_unsure_route_takes_the_best_score_without_a_classifier() -> None:
    engine, ledger, _ = _engine(_answer)
    view = await engine.wait((await engine.submit("write tests for the api documentation")).id, 5)
    assert view.state == "done"
    route = ledger.bodies_of(k.ROUTE, view.id)[0]
    if route["escalate"]:
        [classified] = ledger.bodies_of(k.CLASSIFY, view.id)
        assert classified["source"] == "scores"
        assert view.lane == route["scores"][0][0]
    assert all(c["purpose"] != "classify" for c in ledger.bodies_of(k.MODEL_CALL, view.id))


async def test_a_classifier_sees_the_best_few_lanes_and_general() -> None:
    asked: list[str] = []

    def script(member: str, messages: list[dict[str, Any]]) -> str:
        if "route a request" in str(messages[0]["content"]):
            asked.append(str(messages[1]["content"]))
            return '{"lane": "general"}'
        return "an answer"

    engine, ledger, _ = _engine(script, stronger=True)
    text = "write the api docs and the unit tests"
    view = await engine.wait((await engine.submit(text)).id, 5)
    route = ledger.bodies_of(k.ROUTE, view.id)[0]
    assert route["escalate"], route  # an ambiguous request: three lanes' words
    [classified] = ledger.bodies_of(k.CLASSIFY, view.id)
    assert classified["source"] == "model"
    assert classified["candidates"][-1] == "general"
    assert 2 <= len(classified["candidates"]) <= 5
    assert view.lane == "general"
    listed = [line[2:].split(":")[0] for line in asked[0].splitlines() if line.startswith("- ")]
    assert listed == classified["candidates"]  # the model saw those lanes and no others
