"""Two daemons on loopback: the second uses the first's gateway as a pool member, records where
the first's ledger has each call, and proves it there (`ledger_verify_remote`, and
`tally ledger verify --remote`). A tampered entry on the first daemon fails the proof.

The first daemon's own members are the fake llama-server; everything between the daemons is
real (HTTP over TCP, tokens, the gateway, signed checkpoints, proofs).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from daemon.gateway import REPLY
from daemon.remotes import verify_remote
from daemon.runs import entries as k
from daemon.service import Daemon
from surfaces.cli import main as cli
from surfaces.http import HttpOptions, create_app
from tests.runs.model_server import roster_toml, settings_for
from tests.slots.fake_server import FakeServer
from tests.surfaces.federation import TOKEN_ENV, run_through, second_roster


class Pair:
    def __init__(self, first: Daemon, second: Daemon, roster: Path) -> None:
        self.first = first
        self.second = second
        self.roster = roster


@pytest.fixture
async def pair(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Pair]:
    model = FakeServer(slots=4, n_ctx=4096)
    await model.start()
    (tmp_path / "a").mkdir()
    first = Daemon(settings_for(tmp_path / "a", roster_toml(model.url)))
    await first.start()
    token = first.clients.add("second", "submit")
    monkeypatch.setenv(TOKEN_ENV, token)
    runner = web.AppRunner(create_app(first, HttpOptions(keepalive_s=0.2)))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1"
    key = first.ledger.vkey
    assert key is not None
    (tmp_path / "b").mkdir()
    settings = settings_for(tmp_path / "b", second_roster(url, key))
    second = Daemon(settings)
    await second.start()
    try:
        yield Pair(first, second, tmp_path / "b" / "roster.toml")
    finally:
        await second.stop()
        await runner.cleanup()
        await first.stop()
        await model.stop()


async def test_a_run_through_another_daemon_is_proven_in_its_ledger(pair: Pair) -> None:
    run = await run_through(pair.second)
    [reply] = await pair.second.ledger.entries(limit=100, kind=k.MODEL_REPLY, run=run)
    remote = (await pair.second.ledger.body(reply.body)).value["remote"]
    [theirs] = await pair.first.ledger.entries(limit=100, kind=REPLY)
    assert remote["member"] == "first"
    assert remote["seq"] == theirs.seq
    [call] = await pair.first.ledger.entries(limit=100, kind="gateway.call")
    assert call.actor == "second"  # the first daemon knows who called
    before = await verify_remote(pair.second.ledger, pair.second.roster)
    assert before.pending == 1, before  # no checkpoint of the first daemon covers it yet
    await pair.first.ledger.checkpoint()
    after = await verify_remote(pair.second.ledger, pair.second.roster)
    assert (after.ok, after.failed) == (1, 0), after


async def test_the_cli_proves_it_and_a_tampered_entry_fails(pair: Pair) -> None:
    await run_through(pair.second)
    await pair.first.ledger.checkpoint()
    state = pair.second.settings.state_dir
    code, out = await _cli(["ledger", "verify", "--remote", "--state", str(state), "--roster",
                            str(pair.roster), "--json"])  # fmt: skip
    assert code == 0, out
    assert json.loads(out)["checked"]["remote"]["ok"] == 1
    [theirs] = await pair.first.ledger.entries(limit=100, kind=REPLY)
    _tamper(pair.first.settings.state_dir, theirs.seq, str(theirs.ts))
    code, out = await _cli(["ledger", "verify", "--remote", "--state", str(state), "--roster",
                            str(pair.roster)])  # fmt: skip
    assert code == 1, out
    assert "remote failed" in out
    # The first daemon notices its own index no longer matches and refuses the proof; a
    # daemon that served the proof anyway would fail our leaf-hash check instead.
    assert "proof" in out


async def test_a_wrong_pinned_key_fails(pair: Pair, tmp_path: Path) -> None:
    await run_through(pair.second)
    await pair.first.ledger.checkpoint()
    (tmp_path / "c").mkdir()
    other = Daemon(settings_for(tmp_path / "c", pair.roster.read_text()))
    text = pair.roster.read_text()
    await other.start()
    wrong = other.ledger.vkey
    await other.stop()
    assert wrong is not None
    bad = tmp_path / "bad.toml"
    current = pair.second.roster.member("first")
    assert current is not None
    assert current.tally_key is not None
    bad.write_text(text.replace(current.tally_key, wrong))
    state = pair.second.settings.state_dir
    code, out = await _cli(["ledger", "verify", "--remote", "--state", str(state), "--roster",
                            str(bad)])  # fmt: skip
    assert code == 1
    assert "signature does not verify" in out


def _tamper(state: Path, seq: int, ts: str) -> None:
    """Change one digit of entry `seq`'s timestamp in place (same length, still valid JSON)."""
    path = state / "ledger" / "entries.jsonl"
    data = path.read_bytes()
    lines = data.split(b"\n")
    old = f'"ts":{ts}'.encode()
    assert old in lines[seq]
    digit = ts[-1]
    new_ts = ts[:-1] + ("1" if digit != "1" else "2")
    lines[seq] = lines[seq].replace(old, f'"ts":{new_ts}'.encode())
    path.write_bytes(b"\n".join(lines))


async def _cli(argv: list[str]) -> tuple[int, str]:
    def call() -> tuple[int, str]:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            code = cli(argv)
        return code, out.getvalue()

    return await asyncio.to_thread(call)


def _later(data: dict[str, Any]) -> None:
    data["ts"] += 1


def _with_a_float(data: dict[str, Any]) -> None:
    data["content"]["text_sha256"] = 0.5


def _with_a_lone_surrogate(data: dict[str, Any]) -> None:
    data["content"]["text_sha256"] = "\ud800"  # sent as the JSON escape, parsed back whole


@pytest.mark.parametrize(
    ("alter", "reason"),
    [
        (_later, "inclusion proof fails"),
        (_with_a_float, "not storable in a ledger"),
        (_with_a_lone_surrogate, "not storable in a ledger"),
    ],
)
async def test_an_entry_altered_in_transit_fails(
    pair: Pair, alter: Callable[[dict[str, Any]], None], reason: str
) -> None:
    """A daemon (or a proxy) that serves a different entry line than the one it signed, or a
    body no ledger can hold."""
    await run_through(pair.second)
    await pair.first.ledger.checkpoint()
    member = pair.second.roster.member("first")
    assert member is not None
    assert member.url is not None
    upstream = member.url.removesuffix("/v1")

    async def forward(request: web.Request) -> web.Response:
        async with (
            aiohttp.ClientSession() as http,
            http.post(
                upstream + request.path,
                data=await request.read(),
                headers={"Authorization": request.headers["Authorization"]},
            ) as resp,
        ):
            data = await resp.json()
        if request.path.endswith("/ledger_get"):
            alter(data)
        return web.json_response(data)

    app = web.Application()
    app.router.add_post("/v1/tools/{name}", forward)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1"
        lying = member.model_copy(update={"url": url})
        roster = pair.second.roster.model_copy(update={"models": [lying]})
        report = await verify_remote(pair.second.ledger, roster)
    finally:
        await runner.cleanup()
    assert report.failed == 1
    assert reason in (report.results[0].reason or "")


@pytest.mark.parametrize(
    ("member", "problem"),
    [
        ('tally = true\nurl = "http://127.0.0.1:9/v1"', "tally_key"),
        ('url = "http://127.0.0.1:9/v1"\ntally_key = "not a key"', "C2SP verifier key"),
    ],
)
def test_a_tally_member_needs_a_well_formed_pinned_key(member: str, problem: str) -> None:
    from roster import RosterError
    from roster.loading import load_roster_text

    text = second_roster("http://127.0.0.1:9/v1", "x+00000000+" + "A" * 43 + "=")
    start, end = text.index("[[models]]"), text.index("[tiers]")
    text = text[:start] + f'[[models]]\nname = "first"\n{member}\n\n' + text[end:]
    with pytest.raises(RosterError) as caught:
        load_roster_text(text)
    assert problem in str(caught.value)
    assert "roster.toml:" in str(caught.value)
