"""`tally models scan`, `tally models add` and `tally doctor`, through the real CLI against
real sockets: the fake server (llama.cpp- or Ollama-shaped) on loopback, closed ports, spawned
fake servers, roster files on disk. Scans name their ports: nothing here depends on what else
listens on the usual ones (11434, 8080, 1234, 8000)."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from daemon.slots.process import free_port
from roster import default_roster_path, load_roster
from surfaces.cli import main
from tests.slots.conftest import fake_command
from tests.slots.fake_server import FakeServer

Capsys = pytest.CaptureFixture[str]


@pytest.fixture
async def ollama() -> AsyncIterator[FakeServer]:
    server = FakeServer(ollama=True, models=["qwen2.5:7b", "llama3:8b"])
    await server.start()
    yield server
    await server.stop()


async def cli(*argv: str) -> int:
    """The CLI runs its own event loop: off this one, which serves the fake servers."""
    return await asyncio.to_thread(main, list(argv))


# ---------------------------------------------------------------------------- scan


async def test_scan_finds_an_ollama_style_server_and_names_what_is_closed(
    ollama: FakeServer, capsys: Capsys
) -> None:
    closed = free_port()
    assert await cli("models", "scan", "--port", str(closed), "--url", ollama.url) == 0
    out = capsys.readouterr().out
    assert f"{ollama.url}/v1" in out
    assert "server: ollama" in out
    assert "qwen2.5:7b, llama3:8b" in out
    assert f"127.0.0.1:{closed} [refused]" in out
    assert f"tally models add --url {ollama.url}/v1 --model qwen2.5:7b" in out


async def test_scan_json_reports_llama_cpp_slots_and_context(
    fake: FakeServer, ollama: FakeServer, capsys: Capsys
) -> None:
    code = await cli(
        "models", "scan", "--port", str(fake.port), "--port", str(ollama.port), "--json"
    )
    assert code == 0
    servers = {s["url"]: s for s in json.loads(capsys.readouterr().out)["servers"]}
    llama = servers[f"{fake.url}/v1"]
    assert (llama["found"], llama["kind"], llama["models"]) == (True, "llama.cpp", ["fake"])
    assert (llama["total_slots"], llama["n_ctx"]) == (fake.slots, fake.n_ctx)
    assert servers[f"{ollama.url}/v1"]["kind"] == "ollama"


async def test_scan_finding_nothing_exits_1_and_a_bad_url_2(capsys: Capsys) -> None:
    assert await cli("models", "scan", "--port", str(free_port())) == 1
    assert "no OpenAI-compatible server found" in capsys.readouterr().out
    assert await cli("models", "scan", "--port", str(free_port()), "--url", "ftp://x") == 2
    assert "only http://" in capsys.readouterr().err


async def test_scan_does_not_follow_a_redirect_off_the_machine(capsys: Capsys) -> None:
    from aiohttp import web

    async def models(request: web.Request) -> web.Response:
        raise web.HTTPFound("http://192.0.2.1/v1/models")

    app = web.Application()
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        assert await cli("models", "scan", "--port", str(port), "--json") == 1
        (server,) = json.loads(capsys.readouterr().out)["servers"]
        assert server["problem"].endswith("answered 302")
    finally:
        await runner.cleanup()


# ---------------------------------------------------------------------------- add


def test_add_to_a_new_file_copies_the_default_keeps_comments_and_checks(
    tmp_path: Path, capsys: Capsys
) -> None:
    target = tmp_path / "conf" / "roster.toml"
    argv = ["models", "add", "--url", "127.0.0.1:11434", "--model", "qwen2.5:7b", "--no-probe"]
    assert main([*argv, "--name", "qwen", "--tier", "capable", "--roster", str(target)]) == 0
    out = capsys.readouterr().out
    assert "tier 'capable' = [qwen] (was [tiny])" in out
    assert "comments are kept" in out
    assert "roster check: ok: 25 lanes, 2 tiers, 2 members" in out
    text = target.read_text()
    assert text.startswith("# tally's default roster")  # the default's comments, kept
    roster = load_roster(target)
    qwen = roster.member("qwen")
    assert qwen is not None
    assert (qwen.url, qwen.model_id, qwen.slots) == ("http://127.0.0.1:11434/v1", "qwen2.5:7b", 1)
    assert roster.tiers.members["capable"] == ["qwen"]
    assert roster.tiers.members["cheap"] == ["tiny"]
    default = load_roster(default_roster_path())
    assert roster.lanes == default.lanes
    assert roster.policy == default.policy


def test_add_refuses_to_clobber_and_replace_and_keep_do_what_they_say(
    tmp_path: Path, capsys: Capsys
) -> None:
    target = tmp_path / "roster.toml"
    target.write_text(default_roster_path().read_text())
    target.chmod(0o600)
    add = ["models", "add", "--roster", str(target), "--url", "http://127.0.0.1:11434/v1"]
    add.append("--no-probe")
    assert main([*add, "--model", "a:1", "--name", "m", "--tier", "cheap", "--keep"]) == 0
    before = target.read_bytes()
    assert main([*add, "--model", "b:2", "--name", "m"]) == 1
    assert "already has a member named 'm'" in capsys.readouterr().err
    assert target.read_bytes() == before  # refused: nothing written
    assert main([*add, "--model", "b:2", "--name", "m", "--replace", "--dry-run"]) == 0
    assert '+model_id = "b:2"' in capsys.readouterr().out
    assert target.read_bytes() == before  # a dry run writes nothing
    assert main([*add, "--model", "b:2", "--name", "m", "--replace"]) == 0
    roster = load_roster(target)
    assert [m.name for m in roster.models] == ["tiny", "m"]
    member = roster.member("m")
    assert member is not None
    assert member.model_id == "b:2"
    assert roster.tiers.members["cheap"] == ["m", "tiny"]  # --keep: ahead, the rest stays
    assert target.stat().st_mode & 0o777 == 0o600  # the atomic replace kept the mode
    assert "# Point capable at a stronger member" in target.read_text()


def test_add_a_new_tier_tops_the_ladder(tmp_path: Path, capsys: Capsys) -> None:
    target = tmp_path / "roster.toml"
    argv = ["models", "add", "--roster", str(target), "--url", "127.0.0.1:8080", "--no-probe"]
    assert main([*argv, "--model", "big", "--tier", "best"]) == 0
    assert "on top of the ladder: cheap → capable → best" in capsys.readouterr().out
    roster = load_roster(target)
    assert roster.tiers.ladder == ["cheap", "capable", "best"]
    assert roster.tiers.members["best"] == ["big"]


async def test_add_without_a_tier_writes_what_the_server_says_and_every_call_goes_to_it(
    tmp_path: Path, fake: FakeServer, capsys: Capsys
) -> None:
    """`models scan → add → serve`, then ordinary requests: each model call goes to the
    model added, none to the embedded demo model, which is in no tier any more."""
    from daemon.runs import entries as k
    from daemon.service import Daemon
    from tests.runs.model_server import settings_for

    target = tmp_path / "roster.toml"
    argv = ["models", "add", "--url", fake.url, "--model", "fake", "--name", "mine"]
    assert await cli(*argv, "--roster", str(target)) == 0
    out = capsys.readouterr().out
    assert f"{fake.url}/v1 says: slots {fake.slots}, ctx {fake.n_ctx} (from its /props)" in out
    assert "every lane now starts on 'mine'" in out
    roster = load_roster(target)
    mine = roster.member("mine")
    assert mine is not None
    assert (mine.slots, mine.ctx) == (fake.slots, fake.n_ctx)  # what scan measured: 4 x 2048
    assert roster.tiers.members == {"cheap": ["mine"], "capable": ["mine"]}
    served = tmp_path / "served"
    served.mkdir()
    daemon = Daemon(settings_for(served, target.read_text()))
    await daemon.start()
    try:
        runs = [
            await daemon.engine.submit(request)
            for request in (
                "add an index to the users table",
                "fix the flaky login test",
                "what should I cook tonight",  # no lane's words: general
            )
        ]
        for run in runs:
            view = await daemon.engine.wait(run.id, timeout=30)
            assert view.state == "done", view.error
            calls = await daemon.ledger.entries(limit=1000, kind=k.MODEL_CALL, run=run.id)
            assert calls
            members = {(await daemon.ledger.body(c.body)).value["member"] for c in calls}
            assert members == {"mine"}
        assert len(fake.requests) >= len(runs)
        tiny = daemon.pool.status().member("tiny")
        assert tiny is not None
        assert all(i.pid is None for i in tiny.instances)  # the demo model never started
    finally:
        await daemon.stop()


def test_add_without_a_tier_leaves_a_users_own_climb_alone(tmp_path: Path, capsys: Capsys) -> None:
    """Only the tiers lanes start on, and those that held only the embedded model, change:
    a stronger member the user already put on a higher rung stays there."""
    target = tmp_path / "roster.toml"
    add = ["models", "add", "--roster", str(target), "--no-probe", "--url", "127.0.0.1:9"]
    assert main([*add, "--model", "big", "--tier", "capable"]) == 0
    assert main([*add, "--model", "small", "--keep"]) == 0
    out = capsys.readouterr().out
    assert "tier 'cheap' = [small] (was [tiny])" in out
    roster = load_roster(target)
    assert roster.tiers.members == {"cheap": ["small"], "capable": ["big"]}
    assert "# Point capable at a stronger member" in target.read_text()  # comments kept
    assert main([*add, "--model", "other", "--keep"]) == 0  # --keep: ahead, the rest stays
    assert load_roster(target).tiers.members["cheap"] == ["other", "small"]


def test_add_a_gguf_spawns_the_embedded_server(tmp_path: Path, capsys: Capsys) -> None:
    gguf = tmp_path / "Mistral-7B.Q4_K_M.gguf"
    gguf.write_bytes(b"GGUF")
    target = tmp_path / "roster.toml"
    assert main(["models", "add", "--gguf", str(gguf), "--roster", str(target)]) == 0
    out = capsys.readouterr().out
    assert "every lane now starts on 'mistral-7b.q4_k_m'" in out
    assert "the embedded demo model (tiny) is in no tier now" in out
    roster = load_roster(target)
    assert roster.tiers.members == {
        "cheap": ["mistral-7b.q4_k_m"],
        "capable": ["mistral-7b.q4_k_m"],
    }
    other = tmp_path / "other.toml"
    assert main(["models", "add", "--gguf", str(gguf), "--no-tier", "--roster", str(other)]) == 0
    assert "in no tier yet" in capsys.readouterr().out
    member = load_roster(target).member("mistral-7b.q4_k_m")
    assert member is not None
    assert member.command is not None
    assert member.command[:3] == ["{python}", "-m", "daemon.slots.launcher"]
    assert (member.model, member.slots) == (str(gguf), 2)


def test_add_regenerates_a_file_it_cannot_edit_in_place_and_says_so(
    tmp_path: Path, capsys: Capsys
) -> None:
    target = tmp_path / "roster.toml"
    target.write_text(
        "# my notes\nversion = 1\n"
        'tiers = { ladder = ["cheap"], cheap = ["a"] }\n'
        '[[models]]\nname = "a"\nurl = "http://127.0.0.1:1/v1"\n'
        '[[lanes]]\nname = "x"\nkeywords = ["x"]\ntier = "cheap"\nsystem = "s"\n'
    )
    argv = ["models", "add", "--roster", str(target), "--url", "127.0.0.1:2", "--model", "b"]
    argv.append("--no-probe")
    assert main([*argv, "--tier", "cheap", "--keep"]) == 0  # a list inside it: edited in place
    assert "comments are kept" in capsys.readouterr().out
    assert load_roster(target).tiers.members["cheap"] == ["b", "a"]
    assert main([*argv, "--name", "c", "--tier", "best"]) == 0  # a key added to it: no
    assert "could not be kept in place: it was regenerated" in capsys.readouterr().out
    text = target.read_text()
    assert "# my notes" not in text
    assert text.startswith("# Written by `tally models add`")
    roster = load_roster(target)
    assert roster.tiers.ladder == ["cheap", "best"]
    assert [m.name for m in roster.models] == ["a", "b", "c"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--url", "127.0.0.1:11434"], "--url needs --model"),
        (["--url", "gopher://x", "--model", "m"], "only http://"),
        (["--url", "http://x/v1?key=1", "--model", "m"], "no query"),
        (["--url", "127.0.0.1:1", "--model", "m", "--name", "Bad Name"], "name"),
        (["--url", "127.0.0.1:1", "--model", "m", "--slots", "0"], "slots"),
        (["--gguf", "/nonexistent/x.gguf"], "no such file"),
    ],
)
def test_add_rejects_bad_input_with_a_clear_error(
    tmp_path: Path, capsys: Capsys, argv: list[str], message: str
) -> None:
    target = tmp_path / "roster.toml"
    assert main(["models", "add", "--roster", str(target), *argv]) == 2
    assert message in capsys.readouterr().err
    assert not target.exists()


def test_add_needs_a_roster_and_never_writes_the_packaged_one(
    tmp_path: Path, capsys: Capsys, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TALLY_ROSTER", raising=False)
    argv = ["models", "add", "--url", "127.0.0.1:1", "--model", "m"]
    assert main(argv) == 2
    assert "say which roster to write" in capsys.readouterr().err
    assert main([*argv, "--roster", str(default_roster_path())]) == 2
    assert "packaged default" in capsys.readouterr().err
    broken = tmp_path / "broken.toml"
    broken.write_text("version = 1\n[[lanes]\n")
    assert main([*argv, "--roster", str(broken)]) == 1
    assert "is not a valid roster now" in capsys.readouterr().err
    assert broken.read_text() == "version = 1\n[[lanes]\n"


# ---------------------------------------------------------------------------- doctor


def roster_text(members: str, tier: list[str]) -> str:
    return (
        f'version = 1\n{members}\n[tiers]\nladder = ["t"]\nt = {json.dumps(tier)}\n'
        '[[lanes]]\nname = "x"\nkeywords = ["x"]\ntier = "t"\nsystem = "s"\n'
    )


def spawned_member(name: str, extra: str = "") -> str:
    command = json.dumps(fake_command())
    return f'[[models]]\nname = "{name}"\ncommand = {command}\nslots = 2\nctx = 512\n{extra}'


def url_member(name: str, url: str, model_id: str) -> str:
    return f'[[models]]\nname = "{name}"\nurl = "{url}"\nmodel_id = "{model_id}"\n'


async def test_doctor_names_each_problem_with_its_fix_and_exits_1(
    tmp_path: Path, ollama: FakeServer, capsys: Capsys
) -> None:
    down = f"http://127.0.0.1:{free_port()}/v1"
    members = "\n".join(
        [
            url_member("down", down, "qwen2.5:7b"),
            url_member("wrong", ollama.url + "/v1", "mistral:7b"),
            url_member("good", ollama.url + "/v1", "qwen2.5:7b"),
            spawned_member("nofile", 'model = "models/missing.gguf"\n').replace(
                '"--ctx", "{ctx}"', '"--ctx", "{ctx}", "--model", "{model}"'
            ),
            spawned_member("local"),
        ]
    )
    roster = tmp_path / "roster.toml"
    roster.write_text(roster_text(members, ["down", "wrong", "good", "nofile", "local"]))
    assert await cli("doctor", "--roster", str(roster)) == 1
    out = capsys.readouterr().out
    lines = [line.strip() for line in out.splitlines()]
    problem = {
        line.removeprefix("problem: ").split(":", 1)[0]: line
        for line in lines
        if line.startswith("problem: ")
    }
    assert set(problem) == {"down", "wrong", "nofile"}
    assert "connection refused" in problem["down"]
    assert "start the server" in problem["down"]
    assert "does not list model 'mistral:7b'" in problem["wrong"]
    assert "ollama pull mistral:7b" in problem["wrong"]
    assert f"no model file at {tmp_path / 'models' / 'missing.gguf'}" in problem["nofile"]
    assert "download the model file there" in problem["nofile"]
    assert "FAILED: down, wrong, nofile" in out

    assert await cli("doctor", "--roster", str(roster), "--json") == 1
    report = {m["name"]: m for m in json.loads(capsys.readouterr().out)["members"]}
    assert (report["down"]["ok"], report["down"]["reachable"]) == (False, False)
    assert (report["nofile"]["ok"], report["nofile"]["model_present"]) == (False, False)
    assert report["nofile"]["latency_ms"] is None  # never started: nothing to start it with
    good, local = report["good"], report["local"]
    assert (good["ok"], good["server"], good["model_present"]) == (True, "ollama", True)
    assert good["latency_ms"] is not None
    assert (local["ok"], local["reachable"], local["slots"], local["n_ctx"]) == (
        True,
        True,
        2,
        512,
    )
    assert local["latency_ms"] is not None


async def test_doctor_all_good_exits_0_and_warns_about_capacity(
    tmp_path: Path, fake: FakeServer, capsys: Capsys
) -> None:
    members = url_member("ext", fake.url, "fake").replace(
        'model_id = "fake"\n', 'model_id = "fake"\nslots = 8\nctx = 1024\n'
    )
    roster = tmp_path / "roster.toml"
    roster.write_text(roster_text(members + "\n" + spawned_member("local"), ["ext", "local"]))
    assert await cli("doctor", "--roster", str(roster)) == 0
    out = capsys.readouterr().out
    assert "all members ok (" in out
    assert "problem:" not in out
    # warnings, not failures, and said to be warnings: the fake has 4 slots of 2048 tokens
    assert f"warning: ext: the server has {fake.slots} slots; the roster says slots = 8" in out
    assert await cli("doctor", "--roster", str(roster), "--no-spawn", "--json") == 0
    local = next(m for m in json.loads(capsys.readouterr().out)["members"] if m["name"] == "local")
    assert local["latency_ms"] is None  # --no-spawn: not started


def test_doctor_on_a_roster_that_does_not_load(tmp_path: Path, capsys: Capsys) -> None:
    roster = tmp_path / "roster.toml"
    roster.write_text("version = 2\n")
    assert main(["doctor", "--roster", str(roster)]) == 1
    assert "does not load" in capsys.readouterr().err
    assert not os.environ.get("TALLY_DEBUG")


async def test_doctor_and_the_daemon_resolve_a_relative_model_path_alike(
    tmp_path: Path, capsys: Capsys
) -> None:
    from daemon.service import Daemon
    from tests.runs.model_server import settings_for

    conf = tmp_path / "conf"
    conf.mkdir()
    (conf / "m.gguf").write_bytes(b"GGUF")  # next to the roster, not in the working directory
    text = roster_text(spawned_member("local", 'model = "m.gguf"\n'), ["local"])
    settings = settings_for(conf, text)
    assert await cli("doctor", "--roster", str(settings.roster_path), "--no-spawn") == 0
    capsys.readouterr()
    daemon = Daemon(settings)
    await daemon.start()
    try:
        async with daemon.pool.lease("local", deadline=time.monotonic() + 10):
            pass
    finally:
        await daemon.stop()


def test_a_models_list_keeps_printable_ids_and_at_most_max_models() -> None:
    from daemon.slots.discovery import MAX_MODELS, model_ids

    hostile = {
        "data": [
            {"id": "good"},
            {"id": "\x1b]0;pwned\x07"},
            {"id": "line\nbreak"},
            {"id": ""},
            {"id": 7},
            "not an object",
            *({"id": f"m{i}"} for i in range(100_000)),
        ]
    }
    ids = model_ids(hostile)
    assert ids[0] == "good"
    assert len(ids) == MAX_MODELS
    assert all(i.isprintable() and i for i in ids)
