"""Routing with a real embeddings member (llama.cpp from the xllamacpp wheel, SmolLM2, the
session's one server in tests/routing/conftest.py): the example vectors are built once and
cached, reused by the next router, rebuilt when an example or the cache file changes; the
route carries what was compared; a run witnesses it (`run.embedding` before `run.route`);
a member that is down leaves the keyword route, said so."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from daemon.embeddings import Embeddings, VectorCache, example_key
from daemon.router import Router
from daemon.runs import entries as k
from daemon.service import Daemon
from daemon.slots import Pool
from daemon.slots.process import free_port
from daemon.tools import TOOLS
from daemon.tools.roster import RouteIn, RouteOut
from daemon.tools.tool import Empty, ToolContext
from roster.models import Roster
from surfaces.cli.service import routing_line
from tests.runs.model_server import ScriptedServer, settings_for

pytestmark = pytest.mark.integration

LANES = {
    "cooking": (["recipe", "bake"], ["how do i bake sourdough bread", "a recipe for pancakes"]),
    "devops": (["deploy", "kubernetes"], ["deploy the app to kubernetes", "fix the ci pipeline"]),
    "math": (["integral", "prime"], ["what is the integral of x squared", "is 97 a prime"]),
}


def roster_dict(url: str, examples: dict[str, list[str]] | None = None) -> dict[str, Any]:
    return {
        "policy": {"embeddings": "embed"},
        "models": [{"name": "embed", "url": url, "slots": 2}],
        "tiers": {"ladder": ["cheap"], "cheap": ["embed"]},
        "lanes": [
            {
                "name": name,
                "keywords": words,
                "examples": (examples or {}).get(name, texts),
                "tier": "cheap",
                "system": f"You do {name}.",
            }
            for name, (words, texts) in LANES.items()
        ],
    }


POOLS: list[Pool] = []
SLOW_S = 120.0
"""A request's embedding call may take this long here: the shared 2-core machine is busy."""


async def built(url: str, state: Path, **kw: Any) -> tuple[Pool, Embeddings]:
    roster = Roster.model_validate(roster_dict(url, **kw))
    pool = Pool(roster, state)
    POOLS.append(pool)
    await pool.start()
    found = Embeddings(roster, "embed", pool, state / "embeddings")
    found.query_timeout_s = SLOW_S
    assert await found.ready(240), found.why
    return pool, found


async def test_vectors_are_built_cached_reused_and_rebuilt(
    embeddings_url: str, state_dir: Path
) -> None:
    _, first = await built(embeddings_url, state_dir)
    try:
        assert (first.computed, first.reused, first.problem) == (6, 0, None)
        assert first.digest is not None
        assert (state_dir / "embeddings" / "embed.json").exists()
        router = Router(Roster.model_validate(roster_dict(embeddings_url)), embeddings=first)
        route = await router.aroute("can you deploy my service to the kubernetes cluster")
        assert route.embedding is not None
        assert route.embedding.used, route.embedding
        assert set(route.embedding.lanes) == set(LANES)
        assert route.embedding.examples == 6
        assert route.embedding.ms > 0
        assert all(-1.0 <= c <= 1.0 for c, _ in route.embedding.lanes.values())
        again = await router.aroute("can you deploy my service to the kubernetes cluster")
        assert again.embedding is not None
        assert again.embedding.ms == 0
        assert again.decision == route.decision

        # the next router reuses every vector (a spot check re-embeds two of them)
        _, second = await built(embeddings_url, state_dir)
        assert (second.computed, second.reused, second.problem) == (0, 6, None)
        assert second.digest == first.digest

        # one changed example: that one alone is embedded again
        changed = {"math": ["what is the integral of x squared", "is 101 a prime number"]}
        _, third = await built(embeddings_url, state_dir, examples=changed)
        assert (third.computed, third.reused) == (1, 5)

        # a well-formed file whose vectors the member does not give: all rebuilt
        cache = VectorCache(state_dir / "embeddings", "embed")
        data = json.loads(cache.path.read_text())
        keys = sorted(data["vectors"])
        data["vectors"] = dict.fromkeys(keys, data["vectors"][keys[0]])  # one vector for all
        cache.path.write_text(json.dumps(data))
        _, fourth = await built(embeddings_url, state_dir, examples=changed)
        assert fourth.computed == 6
        assert fourth.reused == 0
        assert fourth.problem is not None
        assert "does not give" in fourth.problem
        assert (
            example_key(fourth.digest or "", "is 101 a prime number")
            in cache.load(fourth.digest or "")[0]
        )
    finally:
        while POOLS:
            await POOLS.pop().stop()


async def test_a_member_that_is_down_leaves_the_keyword_route(state_dir: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
    roster = Roster.model_validate(roster_dict(url))
    pool = Pool(roster, state_dir)
    await pool.start()
    try:
        found = Embeddings(roster, "embed", pool, state_dir / "embeddings")
        router = Router(roster, embeddings=found)
        route = await router.aroute("deploy it to kubernetes", wait=30)
        assert route.embedding is not None
        assert not route.embedding.used
        assert "keyword scores only" in (route.embedding.why or "")
        assert found.state == "down"
        assert found.why
        plain = Router(roster).route("deploy it to kubernetes")
        assert (route.decision, route.scores) == (plain.decision, plain.scores)
    finally:
        await pool.stop()


async def test_a_run_witnesses_what_the_embedding_member_compared(
    embeddings_url: str, tmp_path: Path
) -> None:
    chat = ScriptedServer([], default="done")
    await chat.start()
    data = roster_dict(embeddings_url)
    text = "\n".join(
        [
            '[policy]\nembeddings = "embed"\n',
            f'[[models]]\nname = "embed"\nurl = "{embeddings_url}"\nslots = 2\n',
            f'[[models]]\nname = "tiny"\nurl = "{chat.url}"\nslots = 2\n',
            '[tiers]\nladder = ["cheap"]\ncheap = ["tiny"]\n',
            *(
                f"[[lanes]]\nname = {json.dumps(lane['name'])}\n"
                f"keywords = {json.dumps(lane['keywords'])}\n"
                f"examples = {json.dumps(lane['examples'])}\n"
                f'tier = "cheap"\nsystem = "You help."\n'
                for lane in data["lanes"]
            ),
        ]
    )
    daemon = Daemon(settings_for(tmp_path, text))
    await daemon.start()
    try:
        embeddings = daemon.router.embeddings
        assert embeddings is not None
        embeddings.query_timeout_s = SLOW_S
        assert await embeddings.ready(240), embeddings.why
        status = await TOOLS["status"].handler(daemon, Empty(), ToolContext())
        assert status.routing is not None
        assert (status.routing.embeddings, status.routing.state) == ("embed", "ready")
        assert status.routing.computed + status.routing.reused == 6
        line = routing_line(status.routing.model_dump())
        assert line.startswith("routing: embeddings on embed · example vectors ready: 6 (")
        request = "please deploy the new build to our kubernetes cluster"
        out: RouteOut = await TOOLS["route"].handler(daemon, RouteIn(text=request), ToolContext())
        assert out.embedding is not None
        assert out.embedding.used
        assert {n.lane for n in out.embedding.nearest} == set(LANES)
        view = await daemon.engine.submit(request)
        assert (await daemon.engine.wait(view.id, timeout=60)).state == "done"
        (embedded,) = await daemon.ledger.entries(limit=10, kind=k.EMBEDDING, run=view.id)
        (routed,) = await daemon.ledger.entries(limit=10, kind=k.ROUTE, run=view.id)
        (asked,) = await daemon.ledger.entries(limit=10, kind=k.REQUEST, run=view.id)
        body = (await daemon.ledger.body(embedded.body)).value
        route = (await daemon.ledger.body(routed.body)).value
        assert embedded.parent == asked.seq
        assert routed.parent == asked.seq
        assert route["embedding"] == embedded.seq
        assert body["member"] == "embed"
        assert body["used"] is True
        assert body["digest"] == embeddings.digest
        assert body["examples"] == 6
        assert {lane for lane, _, _ in body["nearest"]} == set(LANES)
        assert all(isinstance(ppm, int) for _, ppm, _ in body["nearest"])
        assert route["lane"] == out.decision.lane == "devops"
        (preview,) = await daemon.ledger.entries(limit=10, kind="route.preview")
        shown = (await daemon.ledger.body(preview.body)).value
        assert shown["embedding"]["nearest"] == body["nearest"]
    finally:
        await daemon.stop()
        await chat.stop()
