"""`tally route` without the daemon asks the roster's embedding member as the daemon does
(`Router.aroute`, the state dir's vector cache) and falls back the same way when it is down:
the in-process fake OpenAI-compatible server answers /v1/embeddings (a vector made from the
text's length, enough to tell the member was asked and to compare two paths)."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import tomllib
from pathlib import Path
from typing import Any

import pytest

from daemon import embeddings
from daemon.router import Router
from daemon.slots import Pool
from daemon.slots.process import free_port
from roster.models import Roster
from surfaces.cli import main
from tests.slots.fake_server import FakeServer

ROSTER = """
[policy]
embeddings = "embed"

[[models]]
name = "embed"
url = "{url}"
slots = 1

[tiers]
ladder = ["cheap"]
cheap = ["embed"]

[[lanes]]
name = "devops"
tier = "cheap"
keywords = ["deploy", "kubernetes"]
examples = ["deploy the app to kubernetes", "fix the ci pipeline"]
system = "You do devops."

[[lanes]]
name = "math"
tier = "cheap"
keywords = ["integral", "prime"]
examples = ["what is the integral of x squared", "is 97 a prime"]
system = "You do math."

[[lanes]]
name = "general"
tier = "cheap"
keywords = ["misc"]
system = "You help."
"""
TEXTS = ["deploy it to kubernetes", "is 91 prime", "what should i cook tonight"]


async def offline(path: Path, state: Path, texts: list[str]) -> tuple[int, list[Any], str]:
    """`tally route --json -` in a thread of its own (it runs its own event loop), so the
    fake server in this one keeps answering."""

    def call() -> tuple[int, str, str]:
        out, err = io.StringIO(), io.StringIO()
        stdin = io.StringIO("".join(f"{t}\n" for t in texts))
        with (
            contextlib.redirect_stdout(out),
            contextlib.redirect_stderr(err),
            pytest.MonkeyPatch.context() as patch,
        ):
            patch.setattr("sys.stdin", stdin)
            code = main(["route", "--json", "--roster", str(path), "--state", str(state), "-"])
        return code, out.getvalue(), err.getvalue()

    code, out, err = await asyncio.wait_for(asyncio.to_thread(call), 120)
    return code, [json.loads(line) for line in out.splitlines()], err


async def daemon_routes(text: str, state: Path, texts: list[str]) -> list[Any]:
    """What the daemon's route tool answers: its router is made this way (Daemon._router_of)."""
    from surfaces.cli.route import as_json

    roster = Roster.model_validate(tomllib.loads(text))
    pool = Pool(roster, state)
    await pool.start()
    found = embeddings.of(roster, pool, state)
    try:
        router = Router(roster, embeddings=found)
        return [json.loads(as_json(await router.aroute(t, 60))) for t in texts]
    finally:
        if found is not None:
            await found.aclose()
        await pool.stop()


def without_ms(route: dict[str, Any]) -> dict[str, Any]:
    embedding = route["embedding"]
    return {**route, "embedding": {**embedding, "ms": 0}}


async def test_offline_route_asks_the_embedding_member_as_the_daemon_does(tmp_path: Path) -> None:
    fake = FakeServer(slots=1)
    url = await fake.start()
    try:
        path = tmp_path / "roster.toml"
        text = ROSTER.format(url=f"{url}/v1")
        path.write_text(text)
        state = tmp_path / "state"
        code, routes, err = await offline(path, state, TEXTS)
        assert code == 0, err
        assert len(routes) == len(TEXTS)
        for route in routes:
            embedding = route["embedding"]
            assert embedding["used"], embedding
            assert embedding["member"] == "embed"
            assert embedding["examples"] == 4  # every lane's examples were compared
            assert embedding["nearest"]
        asked = [r for r in fake.requests if "input" in r]
        assert {r["input"][0] for r in asked} >= set(TEXTS)  # each request was embedded
        assert (state / "embeddings" / "embed.json").is_file()  # the daemon's cache, made
        # the daemon's path over the same cache: the same routes, field for field
        again = await daemon_routes(text, state, TEXTS)
        assert [without_ms(r) for r in again] == [without_ms(r) for r in routes]
    finally:
        await fake.stop()


async def test_offline_route_falls_back_when_the_member_is_down(tmp_path: Path) -> None:
    path = tmp_path / "roster.toml"
    text = ROSTER.format(url=f"http://127.0.0.1:{free_port()}/v1")  # nobody listens there
    path.write_text(text)
    code, routes, err = await offline(path, tmp_path / "state", TEXTS)
    assert code == 0, err
    plain = Router(Roster.model_validate(tomllib.loads(text)))
    for text, route in zip(TEXTS, routes, strict=True):
        embedding = route["embedding"]
        assert not embedding["used"]
        assert "keyword scores only" in embedding["why"]
        keyword = plain.route(text)
        assert route["decision"]["lane"] == keyword.decision.lane
        assert [tuple(s) for s in route["scores"]] == keyword.scores


def test_a_wait_out_of_bounds_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["route", "--wait", "-1", "x"]) == 2
    assert "--wait" in capsys.readouterr().err
