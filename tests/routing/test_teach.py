"""Routing learns from the user: a `submit` that names another lane than the router's is
witnessed with the router's choice beside it, `route_suggest` finds it in the record,
`route_teach` adds the request to the lane's examples in the roster file (its comments kept,
the edit witnessed), and the request and a paraphrase then route there. Through the real
daemon and a fake model server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from daemon.clients import Client
from daemon.errors import Conflict, NotFound
from daemon.runs import entries as k
from daemon.service import Daemon
from daemon.teaching import TEACH
from daemon.tools import TOOLS
from daemon.tools.roster import RouteIn, RouteOut, SuggestIn, TeachIn
from daemon.tools.tool import ToolContext
from roster.edits import add_example
from roster.loading import default_roster_path, load_roster_text
from tests.runs.model_server import ScriptedServer, settings_for

REQUEST = "write a jingle about our kubernetes cluster"
PARAPHRASE = "compose a jingle about the kubernetes cluster"
ADMIN = ToolContext(Client("ops", "admin"))


def default_with_members(url: str) -> str:
    """The packaged roster's text (comments and all) with its members on the fake server."""
    text = default_roster_path().read_text(encoding="utf-8")
    head = text[: text.index("\n[[models]]")]
    lanes = text[text.rindex("\n# ---", 0, text.index("# Lanes. Engineering")) :]
    members = (
        f'\n[[models]]\nname = "tiny"\nurl = "{url}"\nslots = 4\n\n'
        '[tiers]\nladder = ["cheap", "capable"]\ncheap = ["tiny"]\ncapable = ["tiny"]\n'
    )
    return head + members + lanes


def comments(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.lstrip().startswith("#")]


async def _bodies(daemon: Daemon, kind: str, run: str | None = None) -> list[Any]:
    found = await daemon.ledger.entries(start=0, limit=1000, kind=kind, run=run)
    return [(await daemon.ledger.body(e.body)).value for e in found]


async def _lane(daemon: Daemon, text: str) -> str | None:
    out: RouteOut = await TOOLS["route"].handler(daemon, RouteIn(text=text), ToolContext())
    return out.decision.lane


async def test_override_suggest_teach_and_the_route_follows(tmp_path: Path) -> None:
    server = ScriptedServer([], default="done")
    await server.start()
    text = default_with_members(server.url)
    daemon = Daemon(settings_for(tmp_path, text))
    await daemon.start()
    try:
        path = daemon.roster_path
        before = await _lane(daemon, REQUEST)
        assert before not in (None, "writing")  # the topic's words win: devops
        assert await _lane(daemon, PARAPHRASE) == before

        # the user overrides the router: witnessed with the router's own choice beside it
        view = await daemon.engine.submit(REQUEST, lane="writing")
        assert (await daemon.engine.wait(view.id, timeout=30)).state == "done"
        (routed,) = await _bodies(daemon, k.ROUTE, view.id)
        assert routed["source"] == "client"
        assert routed["lane"] == "writing"
        assert routed["router"]["lane"] == before
        assert routed["scores"]
        assert routed["scores"][0][0] == before
        # a client lane the router agrees with is no correction
        same = await daemon.engine.submit("translate this readme into german", lane="translation")
        await daemon.engine.wait(same.id, timeout=30)

        size = daemon.ledger.size
        suggested = await TOOLS["route_suggest"].handler(daemon, SuggestIn(), ToolContext())
        assert daemon.ledger.size == size  # reading the record writes nothing
        assert suggested.overrides == 1
        (first,) = suggested.suggestions
        assert (first.lane, first.text, first.router, first.now) == (
            "writing",
            REQUEST,
            before,
            before,
        )
        assert first.runs == [view.id]
        assert first.teach == f"tally route --teach writing '{REQUEST}'"

        taught = await TOOLS["route_teach"].handler(
            daemon, TeachIn(lane="writing", text=REQUEST), ADMIN
        )
        assert taught.kept_comments
        assert (taught.before.lane, taught.after.lane) == (before, "writing")
        assert taught.after.source == "router"
        edited = path.read_text(encoding="utf-8")
        assert comments(edited) == comments(text)  # every comment kept, in place
        assert f'    "{REQUEST}",\n]' in edited
        lanes = load_roster_text(edited).lanes
        assert REQUEST in next(lane for lane in lanes if lane.name == "writing").examples
        (witnessed,) = await _bodies(daemon, TEACH)
        assert witnessed["lane"] == "writing"
        assert witnessed["text"] == REQUEST
        assert witnessed["before"]["lane"] == before
        assert witnessed["after"] == {"lane": "writing", "source": "router"}
        assert witnessed["client"] == "ops"
        entry = await daemon.ledger.get(taught.seq)
        assert (entry.kind, entry.actor) == (TEACH, "ops")
        assert await _bodies(daemon, "roster.reload")  # the daemon runs the edited roster

        # the request and a paraphrase now go to the taught lane
        assert await _lane(daemon, REQUEST) == "writing"
        assert await _lane(daemon, PARAPHRASE) == "writing"
        after = await daemon.engine.submit(PARAPHRASE)
        assert (await daemon.engine.wait(after.id, timeout=30)).lane == "writing"
        # learnt: nothing left to suggest
        again = await TOOLS["route_suggest"].handler(daemon, SuggestIn(), ToolContext())
        assert again.overrides == 1
        assert again.suggestions == []

        with pytest.raises(Conflict, match="already has this example"):
            await TOOLS["route_teach"].handler(daemon, TeachIn(lane="writing", text=REQUEST), ADMIN)
        with pytest.raises(NotFound, match="no lane 'poetry'"):
            await TOOLS["route_teach"].handler(daemon, TeachIn(lane="poetry", text="x"), ADMIN)
        assert path.read_text(encoding="utf-8") == edited  # refused edits write nothing
    finally:
        await daemon.stop()
        await server.stop()


def test_teach_a_lane_without_examples_and_a_one_line_array() -> None:
    shipped = default_roster_path().read_text(encoding="utf-8")
    # the shipped `general` lane has examples (everyday requests): take them out
    start = shipped.index("examples = [", shipped.index('name = "general"'))
    text = shipped[:start] + shipped[shipped.index("]\n", start) + 2 :]
    general = add_example(text, "r.toml", "general", "what should i cook tonight")
    assert general.kept_comments
    assert comments(general.text) == comments(text)
    assert general.examples == 1
    one_line = text.replace(
        'keywords = ["general", "misc", "miscellaneous"]',
        'keywords = ["general", "misc", "miscellaneous"]  # the fallback\nexamples = ["hi there"]',
    )
    taught = add_example(one_line, "r.toml", "general", "what should i cook tonight")
    assert taught.kept_comments
    assert "# the fallback" in taught.text
    assert 'examples = ["hi there", "what should i cook tonight"]' in taught.text


@pytest.mark.parametrize(
    ("example", "message"),
    [
        ("x" * 501, "at most 500 characters"),
        ("route me \u202e to admin", r"U\+202E"),
        ("zero\u200bwidth", r"U\+200B"),
        ("   ", "blank"),
        ("!!!", "letter or digit"),
    ],
)
def test_teach_refuses_hostile_examples(example: str, message: str) -> None:
    from roster.edits import EditRefused

    text = default_roster_path().read_text(encoding="utf-8")
    with pytest.raises(EditRefused, match=message):
        add_example(text, "r.toml", "writing", example)
