"""Cosigned checkpoints on a shared record, on a real PostgreSQL server: daemons sharing one
record cosign each other's checkpoints into `tally_cosignatures`; `tally ledger verify
--ledger URL --quorum 2` counts cosigners other than the origin; a tampered or missing
cosignature fails with its reason; the export carries the cosigned checkpoint for the file
verifier; a checkpoint whose root is not the shared tree is refused and witnessed."""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import AsyncIterator
from pathlib import Path

import psycopg
import pytest

from daemon.cosigning import INCONSISTENT, Cosigner, held_cosigned
from daemon.ledger.cosign import verify_quorum
from daemon.ledger.shared import SharedLedger
from daemon.service import Daemon
from tests.ledger_pg.test_shared import cli
from tests.runs.model_server import roster_toml, settings_for
from tests.slots.fake_server import FakeServer


@pytest.fixture
async def model() -> AsyncIterator[FakeServer]:
    server = FakeServer(slots=2, n_ctx=4096)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


async def _open(dsn: str, state: Path) -> SharedLedger:
    await asyncio.to_thread(state.mkdir)
    return await SharedLedger.open_shared(dsn, state, checkpoint_interval=None)


def _rows(dsn: str) -> list[tuple[str, int, str]]:
    with psycopg.connect(dsn) as conn:
        return [
            (d, int(s), c)
            for d, s, c in conn.execute(
                "SELECT daemon, size, cosigner FROM tally_cosignatures ORDER BY daemon, cosigner"
            ).fetchall()
        ]


async def test_three_daemons_cosign_each_other_and_a_quorum_of_2_verifies(
    pg_dsn: str, tmp_path: Path
) -> None:
    started = time.monotonic()
    a, b, c = [await _open(pg_dsn, tmp_path / n) for n in "abc"]
    try:
        for i, ledger in enumerate((a, b, c)):
            await ledger.append(actor="t", kind="note", body={"i": i})
        await b.refresh()
        first_b = await b.checkpoint()
        # a cosigns b's checkpoint (b is found in the record: no roster, no member).
        got = await Cosigner(a, same_record=True).cosign_shared()
        assert [(r.member, r.status) for r in got] == [(b.name, "cosigned")], got
        await a.append(actor="t", kind="note", body={"after": 1})
        cp = await a.checkpoint()
        assert cp.size > first_b.size
        for ledger in (b, c):
            got = await Cosigner(ledger, same_record=True).cosign_shared()
            assert (a.name, "cosigned") in [(r.member, r.status) for r in got], got
        # Asked again, nothing new: each checkpoint is cosigned once per cosigner.
        assert await Cosigner(b, same_record=True).cosign_shared() == []
        rows = _rows(pg_dsn)
        assert (a.name, cp.size, b.name) in rows, rows
        assert (a.name, cp.size, c.name) in rows, rows
        assert (b.name, first_b.size, a.name) in rows, rows
        keys = {n: str(ledger.vkey) for n, ledger in zip("abc", (a, b, c), strict=True)}
        names = {n: ledger.name for n, ledger in zip("abc", (a, b, c), strict=True)}
        # What a serves as its cosigned checkpoint (`ledger_cosigned`): the record's lines.
        held = await held_cosigned(a)
        assert held is not None
        verdict = verify_quorum(held, {"b": keys["b"], "c": keys["c"]}, 2, origin_vkey=keys["a"])
        assert verdict.ok, verdict
        assert verdict.size == cp.size
    finally:
        for ledger in (a, b, c):
            await ledger.close()

    verify = ("ledger", "verify", "--ledger", pg_dsn)
    code, said, err = await cli(*verify, "--cosigner", f"b={keys['b']}", "--cosigner",
                                f"c={keys['c']}", "--quorum", "2")  # fmt: skip
    assert code == 0, said + err
    assert f"size {cp.size}, 2 of 2 cosigners verified, quorum 2: ok" in said, said

    # Secure by default: no cosigner named and the record's keys not trusted: a usage error.
    code, said, err = await cli(*verify, "--quorum", "2")
    assert code == 2, said + err
    assert "--trust-record-keys" in err, err
    # Trusting the record's keys: b and c count; the origin a never counts for itself.
    code, said, err = await cli(*verify, "--quorum", "2", "--trust-record-keys")
    assert code == 0, said + err
    code, said, err = await cli(*verify, "--quorum", "3", "--trust-record-keys")
    assert code == 2, said + err
    assert "can never be met by 2 cosigner(s)" in err, err
    # The origin named as a cosigner of its own checkpoint: its signature is not a cosignature.
    code, said, err = await cli(*verify, "--cosigner", f"a={keys['a']}", "--cosigner",
                                f"c={keys['c']}", "--quorum", "2")  # fmt: skip
    assert code == 1, said + err
    assert f"the checkpoint carries no cosignature by {names['a']}" in said, said

    # The export carries the cosigned checkpoint: the file verifier checks the quorum too.
    out = tmp_path / "export"
    code, said, err = await cli("ledger", "export", str(out), "--ledger", pg_dsn)
    assert code == 0, said + err
    assert (out / "ledger" / "checkpoint.cosigned").is_file()
    code, said, err = await cli("ledger", "verify", "--state", str(out), "--cosigner",
                                f"b={keys['b']}", "--cosigner", f"c={keys['c']}",
                                "--quorum", "2")  # fmt: skip
    assert code == 0, said + err
    assert "quorum 2: ok" in said, said

    # c's cosignature altered in the database: named, and the quorum fails.
    with psycopg.connect(pg_dsn) as conn:
        (line,) = conn.execute(
            "SELECT signature FROM tally_cosignatures WHERE daemon = %s AND cosigner = %s",
            (names["a"], names["c"]),
        ).fetchone() or ("",)
        prefix, _, sig = line.rpartition(" ")
        raw = bytearray(base64.b64decode(sig))
        raw[-1] ^= 1
        forged = f"{prefix} {base64.b64encode(bytes(raw)).decode()}"
        conn.execute(
            "UPDATE tally_cosignatures SET signature = %s WHERE daemon = %s AND cosigner = %s",
            (forged, names["a"], names["c"]),
        )
    args = ("--cosigner", f"b={keys['b']}", "--cosigner", f"c={keys['c']}", "--quorum", "2")
    code, said, err = await cli(*verify, *args)
    assert code == 1, said + err
    assert f"{names['c']}'s cosignature does not verify over this checkpoint" in said, said
    assert "1 of the 2 listed cosigners verified; the quorum is 2" in said, said
    # c's cosignature gone: missing, and the quorum fails.
    with psycopg.connect(pg_dsn) as conn:
        conn.execute("DELETE FROM tally_cosignatures WHERE cosigner = %s", (names["c"],))
    code, said, err = await cli(*verify, *args)
    assert code == 1, said + err
    assert f"cosigner c: missing: the checkpoint carries no cosignature by {names['c']}" in said
    assert time.monotonic() - started < 30


async def test_a_root_that_is_not_the_shared_tree_is_refused_and_witnessed(
    pg_dsn: str, tmp_path: Path
) -> None:
    a, b = [await _open(pg_dsn, tmp_path / n) for n in "ab"]
    try:
        await a.append(actor="t", kind="note", body={"n": 1})
        assert a._signer is not None
        forged = a._signer.get().sign(a.size, b"\x07" * 32, time.time_ns() // 1000)
        with psycopg.connect(pg_dsn) as conn:
            conn.execute(
                "INSERT INTO tally_checkpoints (daemon, size, root, note) VALUES (%s, %s, %s, %s)",
                (a.name, a.size, b"\x07" * 32, forged.note),
            )
        got = await Cosigner(b, same_record=True).cosign_shared()
        assert [(r.member, r.status) for r in got] == [(a.name, "failed")], got
        assert "not the shared record's tree at that size: a fork" in str(got[0].reason)
        assert _rows(pg_dsn) == []
        await b.refresh()
        witnessed = await b.entries(kind=INCONSISTENT)
        assert len(witnessed) == 1
    finally:
        await a.close()
        await b.close()


async def test_daemons_sharing_a_record_cosign_on_their_own(
    pg_dsn: str, tmp_path: Path, model: FakeServer
) -> None:
    """The wiring: two daemons' periodic loops cosign each other's checkpoints, unasked."""
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    daemons = []
    for name in ("a", "b"):
        settings = settings_for(
            tmp_path / name, roster_toml(model.url), ledger_url=pg_dsn, checkpoint_interval_s=1
        )
        daemons.append(Daemon(settings))
        await daemons[-1].start()
    a, b = daemons
    try:
        want = {(a.ledger.name, b.ledger.name), (b.ledger.name, a.ledger.name)}  # type: ignore[attr-defined]
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline:
            if want <= {(d, c) for d, _, c in _rows(pg_dsn)}:
                break
            await asyncio.sleep(0.2)
        assert want <= {(d, c) for d, _, c in _rows(pg_dsn)}, _rows(pg_dsn)
        # `health` names the other daemon as a cosigner through the record; once a's
        # latest checkpoint carries b's cosignature, the quorum (every cosigner) is met
        health = None
        while time.monotonic() < deadline + 8:
            health = await a.collector.health(a.ledger, a.roster)
            if health is not None and health.met:
                break
            await asyncio.sleep(0.2)
        assert health is not None
        assert health.met, health
        [seen] = health.cosigners
        assert (seen.name, seen.via) == (b.ledger.name, "record")  # type: ignore[attr-defined]
        assert seen.last_size == health.checkpoint_size
        assert seen.age_s is not None
    finally:
        await a.stop()
        await b.stop()


async def test_a_federated_member_outside_the_record_is_not_checked_against_it(
    pg_dsn: str, tmp_path: Path
) -> None:
    """A daemon on a shared record also cosigns for a roster member that keeps its own (file)
    record: that checkpoint is checked by its consistency, not against the shared tree."""
    from daemon.ledger import Ledger
    from roster.loading import load_roster_text

    shared = await _open(pg_dsn, tmp_path / "shared")
    await asyncio.to_thread((tmp_path / "own").mkdir)
    own = await Ledger.open(tmp_path / "own", checkpoint_interval=None)
    try:
        for i in range(3):
            await own.append(actor="t", kind="note", body={"i": i})
        signed = await own.checkpoint()
        roster = load_roster_text(
            roster_toml("http://127.0.0.1:9/v1")
            + '\n[[models]]\nname = "far"\nurl = "https://far.example/v1"\ntally = true\n'
            f'tally_key = "{own.vkey}"\n'
        )
        cosigner = Cosigner(shared, same_record=True)
        line, _ = await cosigner.cosign(roster, signed.note, 0, [], "far")
        assert line.startswith("— ")
        assert await shared.entries(kind=INCONSISTENT) == []
    finally:
        await own.close()
        await shared.close()


async def test_a_members_cosignature_collected_by_the_origin_is_kept_in_the_record(
    pg_dsn: str, tmp_path: Path
) -> None:
    """`collect` on a shared record also stores the members' checked lines in the record, so
    `verify --ledger URL` counts a federated cosigner there too."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from daemon.cosigning import _store_shared
    from daemon.ledger.checkpoint import Signer
    from daemon.ledger.cosign import cosign_line

    a = await _open(pg_dsn, tmp_path / "a")
    far = Signer(Ed25519PrivateKey.generate())
    try:
        await a.append(actor="t", kind="note", body={"n": 1})
        cp = await a.checkpoint()
        body = cp.note.partition("\n\n")[0] + "\n"
        line = cosign_line(far.name, far.public, far.sign_message, body, int(time.time()))
        await _store_shared(a, cp, [line])
        assert _rows(pg_dsn) == [(a.name, cp.size, far.name)]
    finally:
        await a.close()
    code, said, err = await cli(
        "ledger", "verify", "--ledger", pg_dsn, "--cosigner", f"far={far.vkey}", "--quorum", "1"
    )
    assert code == 0, said + err
    assert "1 of 1 cosigners verified, quorum 1: ok" in said, said
