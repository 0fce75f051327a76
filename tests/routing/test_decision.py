"""`route` says what `submit` does: for every request of a set, the route tool's `decision`
is the lane the run takes, through the real daemon (file ledger, pool, engine) and a fake
OpenAI-compatible model server; with no classifier (the default: the best score or `general`,
no model call) and with a classifier configured (the server answers it)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from daemon.runs import entries as k
from daemon.service import Daemon
from daemon.tools import TOOLS
from daemon.tools.roster import RouteIn, RouteOut
from daemon.tools.tool import ToolContext
from roster.edits import regenerated
from roster.loading import default_roster_path, load_roster
from roster.models import Roster
from tests.routing.labelled import LABELLED, load
from tests.runs.model_server import ScriptedServer, settings_for

STRANGER = LABELLED.with_name("stranger.jsonl")
CLASSIFIER_SAYS = "general"


def roster_text(url: str, classifier: bool) -> str:
    """The default roster's lanes and policy on two members of the fake server; `classifier`:
    `capable` holds a member `cheap` does not, so the classifier runs."""
    data: dict[str, Any] = load_roster(default_roster_path()).model_dump(
        mode="json", exclude_none=True
    )
    data["models"] = [
        {"name": "tiny", "url": url, "slots": 4},
        {"name": "big", "url": url, "slots": 4},
    ]
    capable = ["big"] if classifier else ["tiny"]
    data["tiers"] = {"ladder": ["cheap", "capable"], "cheap": ["tiny"], "capable": capable}
    assert data["policy"]["classifier"] == "capable"
    return regenerated(Roster.model_validate(data))


async def _bodies(daemon: Daemon, kind: str, run: str) -> list[Any]:
    found = await daemon.ledger.entries(start=0, limit=100, kind=kind, run=run)
    return [(await daemon.ledger.body(e.body)).value for e in found]


@pytest.mark.parametrize("classifier", [False, True])
async def test_route_and_submit_agree_on_every_request(tmp_path: Path, classifier: bool) -> None:
    rules: list[tuple[str, str | list[str], float]] = [
        ("You route a request", f'{{"lane": "{CLASSIFIER_SAYS}"}}', 0.0)
    ]
    server = ScriptedServer(rules, default="done")
    await server.start()
    daemon = Daemon(settings_for(tmp_path, roster_text(server.url, classifier)))
    await daemon.start()
    try:
        texts = [example.text for example in load(STRANGER)]
        route = TOOLS["route"]
        previews: list[RouteOut] = [
            await route.handler(daemon, RouteIn(text=text), ToolContext()) for text in texts
        ]
        views = await asyncio.gather(*(daemon.engine.submit(text) for text in texts))
        done = await asyncio.gather(*(daemon.engine.wait(v.id, timeout=120) for v in views))
        sources: set[str] = set()
        for text, preview, view in zip(texts, previews, done, strict=True):
            decision = preview.decision
            sources.add(decision.source)
            assert view.state == "done", (text, view.error)
            classified = await _bodies(daemon, k.CLASSIFY, view.id)
            if decision.source == "classifier":
                assert decision.lane is None
                assert decision.model_call
                assert decision.classifier == "capable"
                assert [c["source"] for c in classified] == ["model"], text
                assert classified[0]["candidates"] == decision.candidates, text
                assert view.lane == CLASSIFIER_SAYS, text
                continue
            assert view.lane == decision.lane, (text, decision)
            assert not decision.model_call
            if decision.source == "router":
                assert classified == [], text
            else:  # escalated, no classifier: the same lane, witnessed without a model call
                assert [c["source"] for c in classified] == [decision.source], text
        calls = [r for r in server.requests if "You route a request" in str(r["messages"])]
        if classifier:
            assert sources == {"router", "general", "classifier"}
            assert len(calls) == sum(p.decision.source == "classifier" for p in previews)
        else:
            assert sources == {"router", "general", "scores"}
            assert calls == []
    finally:
        await daemon.stop()
        await server.stop()
