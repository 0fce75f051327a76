"""Cosigned checkpoints across real daemons on loopback (C2SP tlog-cosignature).

Daemon `a` is the origin; `b` and `c` list it as a tally member (its pinned key) and cosign
its checkpoints; `a` lists them with `cosign = true` and asks them (`ledger_cosign_collect`).
A third party fetches `a`'s cosigned checkpoint over HTTP and requires a quorum of 2; the
CLI does the same offline on `a`'s state dir. Everything between the daemons is real: HTTP
over TCP, client tokens, signed notes, RFC 9162 consistency proofs, the ledgers.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import shutil
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from daemon.cosigning import COSIGN, INCONSISTENT, collect_loop
from daemon.errors import Conflict, InvalidInput, NotFound
from daemon.ledger import Ledger
from daemon.ledger.checkpoint import Signer
from daemon.ledger.cosign import attach, cosign_line, cosigner_vkey, verify_quorum
from daemon.service import Daemon
from surfaces.cli import main as cli
from surfaces.http import HttpOptions, create_app
from tests.runs.model_server import roster_toml, settings_for
from tests.slots.fake_server import FakeServer


def _member(name: str, url: str, key: str, env: str, cosign: bool) -> str:
    return (
        f'\n[[models]]\nname = "{name}"\nurl = "{url}"\ntally = true\ntally_key = "{key}"\n'
        f'api_key_env = "{env}"\ncosign = {"true" if cosign else "false"}\n'
    )


class Trio:
    def __init__(self, daemons: dict[str, Daemon], urls: dict[str, str], tokens: dict[str, str]):
        self.d = daemons
        self.urls = urls
        self.tokens = tokens
        """a: an auditor's read token; b, c: a's submit token there."""

    def vkey(self, name: str) -> str:
        key = self.d[name].ledger.vkey
        assert key is not None
        return key

    async def tool(self, name: str, tool: str, args: dict[str, Any]) -> tuple[int, Any]:
        headers = {"Authorization": f"Bearer {self.tokens[name]}"}
        async with (
            aiohttp.ClientSession() as http,
            http.post(f"{self.urls[name]}/tools/{tool}", json=args, headers=headers) as resp,
        ):
            return resp.status, await resp.json()


@pytest.fixture
async def trio(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Trio]:
    model = FakeServer(slots=2, n_ctx=4096)
    await model.start()
    base = roster_toml(model.url)
    daemons: dict[str, Daemon] = {}
    runners: list[web.AppRunner] = []
    urls: dict[str, str] = {}
    try:
        for name in ("a", "b", "c"):
            (tmp_path / name).mkdir()
            daemon = Daemon(settings_for(tmp_path / name, base))
            await daemon.start()
            daemons[name] = daemon
            runner = web.AppRunner(create_app(daemon, HttpOptions(keepalive_s=0.2)))
            await runner.setup()
            runners.append(runner)
            await web.TCPSite(runner, "127.0.0.1", 0).start()
            urls[name] = f"http://127.0.0.1:{runner.addresses[0][1]}/v1"
        keys = {n: d.ledger.vkey for n, d in daemons.items()}
        origin = base
        tokens: dict[str, str] = {}
        for name in ("b", "c"):
            env = f"COSIGN_TEST_TOKEN_{name.upper()}"
            tokens[name] = daemons[name].clients.add("a", "submit")
            monkeypatch.setenv(env, tokens[name])
            origin += _member(name, urls[name], str(keys[name]), env, cosign=True)
            theirs = base + _member("a", urls["a"], str(keys["a"]), "COSIGN_TEST_UNUSED", False)
            (tmp_path / name / "roster.toml").write_text(theirs)
            await daemons[name].reload_roster()
        (tmp_path / "a" / "roster.toml").write_text(origin)
        await daemons["a"].reload_roster()
        tokens["a"] = daemons["a"].clients.add("auditor", "read")
        yield Trio(daemons, urls, tokens)
    finally:
        for runner in runners:
            await runner.cleanup()
        for daemon in daemons.values():
            await daemon.stop()
        await model.stop()


async def _grow(daemon: Daemon, n: int) -> None:
    for i in range(n):
        await daemon.ledger.append(actor="test", kind="test.note", body={"i": i})


async def _collect(trio: Trio) -> dict[str, Any]:
    report = await trio.d["a"].collector.collect(trio.d["a"].ledger, trio.d["a"].roster)
    return report.model_dump()


async def _cli(argv: list[str]) -> tuple[int, str]:
    def call() -> tuple[int, str]:
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            code = cli(argv)
        return code, out.getvalue()

    return await asyncio.to_thread(call)


async def test_a_cosigned_checkpoint_verifies_with_a_quorum_of_2(trio: Trio) -> None:
    a = trio.d["a"]
    await _grow(a, 5)
    await a.ledger.checkpoint()
    status, health = await trio.tool("a", "health", {})  # asked no one yet: no quorum
    assert status == 200, health
    cosigning = health["cosigning"]
    assert (cosigning["quorum"], cosigning["cosigned"], cosigning["met"]) == (2, 0, False)
    assert [(c["name"], c["via"], c["last_size"]) for c in cosigning["cosigners"]] == [
        ("b", "member", None),
        ("c", "member", None),
    ]
    report = await _collect(trio)
    assert [r["status"] for r in report["results"]] == ["cosigned", "cosigned"], report
    _, health = await trio.tool("a", "health", {})
    cosigning = health["cosigning"]
    assert (cosigning["cosigned"], cosigning["met"]) == (2, True), cosigning
    for cosigner in cosigning["cosigners"]:
        assert cosigner["last_size"] == report["size"] == cosigning["checkpoint_size"]
        assert 0 <= cosigner["age_s"] < 60, cosigner
        assert cosigner["failures"] == 0, cosigner
    _, unasked = await trio.tool("b", "health", {})  # b asks no one for cosignatures
    assert unasked["cosigning"] is None
    # each cosigner witnessed what it cosigned, in its own ledger
    for name in ("b", "c"):
        [entry] = await trio.d[name].ledger.entries(limit=10, kind=COSIGN)
        body = (await trio.d[name].ledger.body(entry.body)).value
        latest = a.ledger.latest_checkpoint()
        assert latest is not None
        assert (body["origin"], body["size"], body["root"]) == (
            latest.origin,
            latest.size,
            latest.root,
        )
        assert body["member"] == "a"
    # asked again about the same checkpoint: a fresh line, witnessed once all the same
    repeat = await _collect(trio)
    assert [r["status"] for r in repeat["results"]] == ["cosigned", "cosigned"], repeat
    assert len(await trio.d["b"].ledger.entries(limit=10, kind=COSIGN)) == 1
    # a third party: the cosigned note over HTTP (read scope), its own pinned keys, quorum 2
    status, served = await trio.tool("a", "ledger_cosigned", {})
    assert status == 200, served
    assert len(served["cosigners"]) == 2
    note = served["note"]
    cosigners = {"b": trio.vkey("b"), "c": trio.vkey("c")}
    verdict = verify_quorum(note, cosigners, 2, origin_vkey=trio.vkey("a"))
    assert verdict.ok, verdict
    assert verdict.origin_signature == "valid"
    assert [r.status for r in verdict.results] == ["verified", "verified"]
    # the 0x04 form of the keys (as `ledger_cosigned` prints each daemon's own) works alike
    _, b_served = await trio.tool("b", "ledger_cosigned", {})
    typed = {"b": b_served["cosigner_vkey"], "c": trio.vkey("c")}
    assert verify_quorum(note, typed, 2, origin_vkey=trio.vkey("a")).ok
    # the CLI, offline on a's state dir (the note the daemon collected there)
    state = str(a.settings.state_dir)
    argv = ["ledger", "verify", "--state", state, "--quorum", "2",
            "--cosigner", f"b={trio.vkey('b')}", "--cosigner", f"c={trio.vkey('c')}"]  # fmt: skip
    code, out = await _cli(argv)
    assert code == 0, out
    assert "2 of 2 cosigners verified, quorum 2: ok" in out
    code, out = await _cli([*argv, "--json"])
    assert json.loads(out)["checked"]["cosigned"]["consistent"] is True
    # the checkpoint grows: the cosigners check consistency from what they cosigned. The
    # origin forgot the sizes they hold (a restart): each says its size (409), and is asked
    # again with a proof from there.
    await _grow(a, 7)
    await a.ledger.checkpoint()
    a.collector.sizes.clear()
    again = await _collect(trio)
    assert [r["status"] for r in again["results"]] == ["cosigned", "cosigned"], again
    latest = a.ledger.latest_checkpoint()
    assert latest is not None
    assert again["size"] == latest.size >= report["size"] + 7
    assert verify_quorum(again["note"], cosigners, 2, origin_vkey=trio.vkey("a")).ok
    # an older checkpoint sent again afterwards is refused: a rollback
    b = trio.d["b"]
    assert b.cosigner is not None
    with pytest.raises(Conflict, match="older"):
        await b.cosigner.cosign(b.roster, note, 0, [], "a")
    assert len(await b.ledger.entries(limit=10, kind=COSIGN)) == 2


async def test_the_daemon_asks_after_each_checkpoint_period(trio: Trio) -> None:
    a = trio.d["a"]
    await _grow(a, 2)
    signed = await a.ledger.checkpoint()
    loop = asyncio.create_task(collect_loop(a.collector, a.ledger, lambda: a.roster, 0.1))
    try:
        for _ in range(100):  # the loop's period is at least 1 s
            _, served = await trio.tool("a", "ledger_cosigned", {})
            if served["size"] == signed.size and len(served["cosigners"]) == 2:
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError(f"not cosigned in 10 s: {served}")
    finally:
        loop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loop


async def test_wrong_keys_tampering_and_stale_cosignatures_are_refused(trio: Trio) -> None:
    a = trio.d["a"]
    await _grow(a, 3)
    await a.ledger.checkpoint()
    note = (await _collect(trio))["note"]
    good = {"b": trio.vkey("b"), "c": trio.vkey("c")}
    origin = trio.vkey("a")
    # a wrong key: the origin's own key listed as a cosigner has no cosignature there
    wrong = {"b": trio.vkey("b"), "c": trio.vkey("a")}
    verdict = verify_quorum(note, wrong, 2, origin_vkey=origin)
    assert not verdict.ok
    assert verdict.results[1].status == "missing"
    assert "no cosignature by" in (verdict.results[1].reason or "")
    assert "1 of the 2 listed cosigners verified; the quorum is 2" in (verdict.reason or "")
    # one key listed twice counts once
    twice = verify_quorum(note, {"b": good["b"], "b2": good["b"]}, 2, origin_vkey=origin)
    assert not twice.ok
    assert "counts once" in (twice.results[1].reason or "")
    # a tampered checkpoint: another root under the same signature lines
    body, _, sigs = note.partition("\n\n")
    lines = body.split("\n")
    root = base64.b64decode(lines[2])
    lines[2] = base64.b64encode(bytes([root[0] ^ 1]) + root[1:]).decode()
    tampered = "\n".join(lines) + "\n\n" + sigs
    verdict = verify_quorum(tampered, good, 2, origin_vkey=origin)
    assert not verdict.ok
    assert verdict.origin_signature.startswith("INVALID")
    assert all(r.status == "failed" for r in verdict.results)
    assert all("does not verify over this checkpoint" in (r.reason or "") for r in verdict.results)
    # a stale cosignature: last checkpoint's lines on the next checkpoint
    await _grow(a, 2)
    fresh = await a.ledger.checkpoint()
    stale = attach(fresh.note, note.partition("\n\n")[2].rstrip("\n").split("\n")[1:])
    verdict = verify_quorum(stale, good, 2, origin_vkey=origin)
    assert not verdict.ok
    assert "made for another checkpoint" in (verdict.results[0].reason or "")
    # an old one, by the verifier's freshness rule
    later = time.time() + 3600
    verdict = verify_quorum(note, good, 2, origin_vkey=origin, now=later, max_age_s=600)
    assert not verdict.ok
    assert "stale" in (verdict.results[0].reason or "")
    # the CLI names each and fails
    saved = Path(a.settings.state_dir).parent / "tampered.note"
    saved.write_text(tampered)
    code, out = await _cli(["ledger", "verify", "--state", str(a.settings.state_dir),
                            "--cosigned", str(saved), "--quorum", "2",
                            *_listed(good)])  # fmt: skip
    assert code == 1, out
    assert "cosigner b: failed" in out
    assert "FAILED" in out
    code, out = await _cli(["ledger", "verify", "--state", str(a.settings.state_dir),
                            "--quorum", "3", "--cosigner", f"b={good['b']}"])  # fmt: skip
    assert code == 2
    assert "can never be met" in out
    # a daemon that collected none: said so, and not ok
    code, out = await _cli(["ledger", "verify", "--state", str(trio.d["b"].settings.state_dir),
                            *_listed(good)])  # fmt: skip
    assert code == 1, out
    assert "no cosigned checkpoint in" in out
    code, out = await _cli(["ledger", "verify", "--state", str(a.settings.state_dir),
                            "--cosigner", "b=not-a-key"])  # fmt: skip
    assert code == 2
    assert "--cosigner b: bad cosigner key" in out


def _listed(cosigners: dict[str, str]) -> list[str]:
    return [arg for name, key in cosigners.items() for arg in ("--cosigner", f"{name}={key}")]


async def _fork(trio: Trio, tmp_path: Path, entries: int) -> Ledger:
    """A ledger signed with a's key whose history differs from a's (a split view)."""
    state = tmp_path / "fork"
    (state / "ledger").mkdir(parents=True)
    shutil.copy(trio.d["a"].ledger.dir / "checkpoint.key", state / "ledger" / "checkpoint.key")
    fork = await Ledger.open(state, checkpoint_interval=None)
    for i in range(entries):
        await fork.append(actor="liar", kind="test.other", body={"i": i})
    return fork


async def test_the_cosigner_refuses_and_witnesses_a_fork(trio: Trio, tmp_path: Path) -> None:
    a = trio.d["a"]
    await _grow(a, 4)
    signed = await a.ledger.checkpoint()
    assert [r["status"] for r in (await _collect(trio))["results"]] == ["cosigned"] * 2
    b = trio.d["b"]
    assert b.cosigner is not None
    # a larger tree that does not extend the one b cosigned: its proof cannot verify
    fork = await _fork(trio, tmp_path, signed.size + 3)
    try:
        forked = await fork.checkpoint()
        assert forked.origin == signed.origin
        proof = (await fork.consistency_proof(signed.size, forked.size)).path
        status, answer = await trio.tool(
            "b", "ledger_cosign", {"note": forked.note, "old_size": signed.size, "proof": proof}
        )
        assert status == 409, answer
        assert "not proven consistent" in answer["error"]["message"], answer
        assert answer["error"]["details"]["inconsistent"] is True
        # the same size with another root: two signed roots, a proven fork
        same = await _fork(trio, tmp_path / "same", 0)
        await _grow_ledger(same, signed.size)
        other = await same.checkpoint()
        await same.close()
        assert other.size == signed.size
        assert other.root != signed.root
        with pytest.raises(Conflict) as caught:
            await b.cosigner.cosign(b.roster, other.note, signed.size, [], "a")
        assert "a fork" in str(caught.value)
        witnessed = await b.ledger.entries(limit=10, kind=INCONSISTENT)
        bodies = [(await b.ledger.body(e.body)).value for e in witnessed]
        assert [body["proven_fork"] for body in bodies] == [False, True]
        assert bodies[1]["cosigned_root"] == signed.root
        assert bodies[1]["root"] == other.root
        # sent again: refused again, witnessed once
        with pytest.raises(Conflict):
            await b.cosigner.cosign(b.roster, other.note, signed.size, [], "a")
        assert len(await b.ledger.entries(limit=10, kind=INCONSISTENT)) == 2
        # and b still cosigns a's honest next checkpoint
        await _grow(a, 1)
        await a.ledger.checkpoint()
        assert [r["status"] for r in (await _collect(trio))["results"]] == ["cosigned"] * 2
        # a verifier whose copy is a's, handed a fork cosigned by a lied-to cosigner, refuses
        await _split_view(trio, fork, tmp_path)
    finally:
        await fork.close()


async def _grow_ledger(ledger: Ledger, n: int) -> None:
    for i in range(n):
        await ledger.append(actor="liar", kind="test.other", body={"i": i})


async def _split_view(trio: Trio, fork: Ledger, tmp_path: Path) -> None:
    forked = await fork.checkpoint()
    lines = []
    for name in ("b", "c"):
        pem = (trio.d[name].ledger.dir / "checkpoint.key").read_bytes()
        signer = Signer.load(pem, Path(name))
        body = forked.note.partition("\n\n")[0] + "\n"
        lines.append(cosign_line(signer.name, signer.public, signer.sign_message, body,
                                 int(time.time())))  # fmt: skip
        assert cosigner_vkey(signer.name, signer.public)
    note = attach(forked.note, lines)
    good = {"b": trio.vkey("b"), "c": trio.vkey("c")}
    assert verify_quorum(note, good, 2, origin_vkey=trio.vkey("a")).ok  # signatures alone pass
    saved = tmp_path / "split.note"
    saved.write_text(note)
    code, out = await _cli(["ledger", "verify", "--state", str(trio.d["a"].settings.state_dir),
                            "--cosigned", str(saved), "--quorum", "2",
                            *_listed(good)])  # fmt: skip
    assert code == 1, out
    assert "not consistent with this ledger" in out


async def test_the_cosigner_refuses_unknown_origins_and_bad_signatures(
    trio: Trio, tmp_path: Path
) -> None:
    b = trio.d["b"]
    c = trio.d["c"]
    await _grow(c, 2)
    theirs = await c.ledger.checkpoint()  # c is not a member of b's roster
    assert b.cosigner is not None
    with pytest.raises(NotFound) as caught:
        await b.cosigner.cosign(b.roster, theirs.note, 0, [], "x")
    assert "no tally member's pinned key is named" in str(caught.value)
    a = trio.d["a"]
    await _grow(a, 2)
    ours = await a.ledger.checkpoint()
    body, _, line = ours.note.partition("\n\n")
    name, b64 = line.rstrip("\n").split(" ")[1:]
    raw = bytearray(base64.b64decode(b64))
    raw[-1] ^= 1  # the key id still matches: the signature itself is wrong
    bad = f"{body}\n\n— {name} {base64.b64encode(bytes(raw)).decode()}\n"
    with pytest.raises(InvalidInput) as refused:
        await b.cosigner.cosign(b.roster, bad, 0, [], "x")
    assert "does not verify under the key pinned for member 'a'" in str(refused.value)
    assert "signature does not verify" in str(refused.value)
    assert await b.ledger.entries(limit=10, kind=COSIGN) == []


async def test_a_cosigner_over_tls_with_its_certificate_pinned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from daemon.tls import fingerprint
    from tests.surfaces.test_tls import start_served

    model = FakeServer(slots=2, n_ctx=4096)
    await model.start()
    base = roster_toml(model.url)
    (tmp_path / "a").mkdir()
    a = Daemon(settings_for(tmp_path / "a", base))
    await a.start()
    b = None
    try:
        origin_key = str(a.ledger.vkey)
        # b never calls a: the origin's URL is only where it would be reached
        b = await start_served(
            tmp_path / "b", base + _member("a", "http://127.0.0.1:9/v1", origin_key, "X", False)
        )
        assert b.cert is not None
        monkeypatch.setenv("COSIGN_TLS_TOKEN", b.daemon.clients.add("a", "submit"))
        pin = fingerprint(b.cert.read_bytes())
        member = _member("b", f"{b.origin}/v1", str(b.daemon.ledger.vkey), "COSIGN_TLS_TOKEN", True)
        text = base + member.replace("tally = true\n", f'tally = true\ntls_fingerprint = "{pin}"\n')
        (tmp_path / "a" / "roster.toml").write_text(text)
        await a.reload_roster()
        await _grow(a, 3)
        await a.ledger.checkpoint()
        report = await a.collector.collect(a.ledger, a.roster)
        assert [r.status for r in report.results] == ["cosigned"], report
        assert report.note is not None
        verdict = verify_quorum(report.note, {"b": str(b.daemon.ledger.vkey)}, 1,
                                origin_vkey=origin_key)  # fmt: skip
        assert verdict.ok, verdict
        cosigned_size = report.size
        # another certificate pinned: nothing is sent, the member's answer is a reason
        (tmp_path / "a" / "roster.toml").write_text(text.replace(pin, "sha256:" + "0" * 64))
        await a.reload_roster()
        await a.ledger.checkpoint()
        report = await a.collector.collect(a.ledger, a.roster)
        assert [r.status for r in report.results] == ["failed"], report
        assert "is not the pinned one" in (report.results[0].reason or ""), report
        health = await a.collector.health(a.ledger, a.roster)  # what `health` shows
        assert health is not None
        assert not health.met, health
        [seen] = health.cosigners
        assert (seen.name, seen.failures, seen.last_size) == ("b", 1, cosigned_size), health
        assert "is not the pinned one" in (seen.reason or "")
    finally:
        if b is not None:
            await b.close()
        await a.stop()
        await model.stop()


async def test_on_a_shared_record_the_cosigner_checks_its_own_tree(trio: Trio) -> None:
    """Daemons sharing one record (`same_record`): the root must be the one the cosigner reads
    itself, the first checkpoint of an origin too. Here a's ledger stands for the shared
    record (a cosigner over it agrees) and b's for another record (it refuses)."""
    from daemon.cosigning import Cosigner

    a, b = trio.d["a"], trio.d["b"]
    await _grow(a, 3)
    signed = await a.ledger.checkpoint()
    sharing = Cosigner(a.ledger, same_record=True)
    line, _ = await sharing.cosign(b.roster, signed.note, 0, [], "a")
    assert line.startswith("— ")
    other = Cosigner(b.ledger, same_record=True)
    with pytest.raises(Conflict, match="fewer than the checkpoint's"):
        await other.cosign(b.roster, signed.note, 0, [], "a")
    await _grow(b, signed.size)
    with pytest.raises(Conflict, match="not the shared record's tree"):
        await other.cosign(b.roster, signed.note, 0, [], "a")
    [witnessed] = await b.ledger.entries(limit=10, kind=INCONSISTENT)
    assert (await b.ledger.body(witnessed.body)).value["proven_fork"] is True
    assert await b.ledger.entries(limit=10, kind=COSIGN) == []


def test_cosign_is_for_tally_members_only() -> None:
    from roster import RosterError
    from roster.loading import load_roster_text

    text = roster_toml("http://127.0.0.1:9/v1") + '\n[[models]]\nname = "x"\n'
    text += 'url = "http://127.0.0.1:9/v1"\ncosign = true\n'
    with pytest.raises(RosterError, match="'cosign = true' needs 'tally = true'"):
        load_roster_text(text)
