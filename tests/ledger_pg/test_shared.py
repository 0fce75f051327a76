"""The shared record on a real PostgreSQL server: daemons in their own processes appending at
once, SIGKILLed mid-load, the server stopped mid-load; every acknowledged entry is in the
record, every proof verifies under the independent RFC 9162 reference, the chain never forks,
and the export reads back with the file ledger's own verifier."""

from __future__ import annotations

import asyncio
import contextlib
import io
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from aiohttp.test_utils import TestClient, TestServer

from daemon.errors import NotFound
from daemon.ledger import Entry, LedgerUnwritable, verify_note
from daemon.ledger.entry import GENESIS_PREV
from daemon.ledger.postgres import JOIN_KIND
from daemon.ledger.shared import SharedLedger
from daemon.service import Daemon
from surfaces.cli import main
from surfaces.http import HttpOptions, create_app
from tests.ledger import rfc9162
from tests.ledger_pg.server import Server
from tests.runs.model_server import roster_toml, settings_for
from tests.slots.fake_server import FakeServer

ROOT = Path(__file__).resolve().parents[2]


async def cli(*args: str) -> tuple[int, str, str]:
    """`tally ARGS` in a worker thread (its own event loop), as from a shell: exit, out, err."""

    def run() -> tuple[int, str, str]:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as exit:
                code = int(exit.code or 0)
        return code, out.getvalue(), err.getvalue()

    return await asyncio.to_thread(run)


def child(
    dsn: str, state: Path, count: int, gated: bool = False, halves: bool = False
) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "tests.ledger_pg.child", dsn, str(state), str(count)]
        + (["gated"] if gated else [])
        + (["halves"] if halves else []),
        cwd=ROOT,
        stdin=subprocess.PIPE if gated or halves else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def _until_half(proc: subprocess.Popen[bytes]) -> bytes:
    """What a `halves` child printed up to its `half` line (bounded by the test's timeout)."""
    assert proc.stdout is not None
    seen = b""
    while not seen.endswith(b"\n") or b"half " not in seen.rsplit(b"\n", 2)[-2]:
        line = proc.stdout.readline()
        assert line, f"the child ended before its half: {seen[-400:]!r}"
        seen += line
    return seen


def _finish(proc: subprocess.Popen[bytes]) -> bytes:
    """Release a `halves` child and read the rest of what it prints (its buffered reader's
    lines included, which `communicate` would skip)."""
    assert proc.stdin is not None
    assert proc.stdout is not None
    proc.stdin.write(b"go\n")
    proc.stdin.close()
    rest = proc.stdout.read()
    proc.wait(timeout=60)
    return rest


def acks(output: bytes) -> dict[int, str]:
    """The entries a child printed as acknowledged (a line cut by the kill is not one)."""
    found: dict[int, str] = {}
    for line in output.split(b"\n"):
        parts = line.split()
        if len(parts) == 2 and parts[0].isdigit() and len(parts[1]) == 64:
            found[int(parts[0])] = parts[1].decode()
    return found


def record_lines(dsn: str) -> tuple[list[bytes], list[str]]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT seq, line, daemon FROM tally_entries ORDER BY seq").fetchall()
    assert [r[0] for r in rows] == list(range(len(rows)))  # no gap, no duplicate seq
    return [bytes(r[1]) for r in rows], [r[2] for r in rows]


def check_chain(lines: list[bytes]) -> None:
    """One chain: every entry's prev is the leaf hash of the entry before it (no fork)."""
    prev = GENESIS_PREV
    for seq, line in enumerate(lines):
        entry = Entry.from_line(line)  # canonical, or it raises
        assert (entry.seq, entry.prev) == (seq, prev), seq
        prev = entry.hash


async def test_two_daemons_append_at_once_into_one_chain(pg_dsn: str, tmp_path: Path) -> None:
    procs = [child(pg_dsn, tmp_path / name, 10, halves=True) for name in ("a", "b")]
    firsts = [_until_half(p) for p in procs]  # both children's first halves are in the record
    outs = [first + _finish(p) for first, p in zip(firsts, procs, strict=True)]
    assert [p.returncode for p in procs] == [0, 0]
    acked = [acks(out) for out in outs]
    assert [len(a) for a in acked] == [640, 640]
    assert not set(acked[0]) & set(acked[1])
    lines, writers = record_lines(pg_dsn)
    check_chain(lines)
    assert len(lines) == 1280 + 2  # and each daemon's `ledger.join`
    owners = [out.split(b"\n")[0].split()[1].decode() for out in outs]  # "ready NAME"
    names = set(owners)
    assert set(writers) == names
    for mine, name in zip(acked, owners, strict=True):
        for seq, leaf in mine.items():
            assert rfc9162._h(b"\x00" + lines[seq]).hex() == leaf
            assert writers[seq] == name  # the record says who wrote it
    # Both daemons' entries are in each half of the record (the children wait for each other
    # halfway), so their batches interleave, yet there is one chain.
    switches = sum(1 for x, y in itertools.pairwise(writers) if x != y)
    assert switches >= 2
    reader = await SharedLedger.open_shared(pg_dsn, None, readonly=True)
    try:
        size = reader.size
        root = rfc9162.mth(lines)
        assert bytes.fromhex(reader.root()) == root
        for seq in range(size):  # every proof, by the independent reference
            proof = await reader.inclusion_proof(seq)
            path = [bytes.fromhex(p) for p in proof.path]
            assert rfc9162.verify_inclusion(seq, size, lines[seq], path, root), seq
        consistency = await reader.consistency_proof(640, size)
        assert bytes.fromhex(consistency.old_root) == rfc9162.mth(lines[:640])
        report = await reader.verify(deep=True)
        assert report.ok, report
        assert report.size == size
        # Each daemon's checkpoints are in the record, each signed by its own key.
        with psycopg.connect(pg_dsn) as conn:
            keys: dict[str, str] = dict(
                conn.execute("SELECT name, vkey FROM tally_daemons").fetchall()
            )
            notes = conn.execute("SELECT daemon, size, note FROM tally_checkpoints").fetchall()
        assert {d for d, _, _ in notes} == names
        for daemon, at, note in notes:
            assert verify_note(note, keys[daemon]).root == rfc9162.mth(lines[:at]).hex()
    finally:
        await reader.close()


async def test_sigkill_mid_load_ten_times_loses_nothing_acknowledged(
    pg_dsn: str, tmp_path: Path
) -> None:
    steady = child(pg_dsn, tmp_path / "steady", 0)  # the other daemon, under load throughout
    acked: dict[int, str] = {}
    try:
        upcoming = child(pg_dsn, tmp_path / "victim", 0, gated=True)
        for round_ in range(10):
            # The same daemon (state dir) each time; the next one's interpreter starts early.
            victim = upcoming
            assert victim.stdin is not None
            assert victim.stdout is not None
            victim.stdin.write(b"go\n")
            victim.stdin.flush()
            if round_ < 9:
                upcoming = child(pg_dsn, tmp_path / "victim", 0, gated=True)
            seen = b""
            deadline = time.monotonic() + 20
            while seen.count(b"\n") < 30 and time.monotonic() < deadline:
                seen += os.read(victim.stdout.fileno(), 65536)
            victim.send_signal(signal.SIGKILL)
            rest, _ = victim.communicate(timeout=10)
            got = acks(seen + rest)
            assert got, "the victim acknowledged nothing before its kill"
            acked.update(got)
    finally:
        steady.send_signal(signal.SIGKILL)
        rest, _ = steady.communicate(timeout=10)
    acked.update(acks(rest))
    lines, _ = record_lines(pg_dsn)
    check_chain(lines)
    for seq, leaf in acked.items():  # every acknowledged entry is there, as acknowledged
        assert rfc9162._h(b"\x00" + lines[seq]).hex() == leaf, seq
    with psycopg.connect(pg_dsn) as conn:
        joins = conn.execute("SELECT count(*) FROM tally_entries WHERE kind = %s", (JOIN_KIND,))
        assert joins.fetchone() == (2,)  # a restarted daemon is the same daemon (its key)
    reader = await SharedLedger.open_shared(pg_dsn, None, readonly=True)
    try:
        assert (await reader.verify(deep=True)).ok
    finally:
        await reader.close()


@pytest.fixture
async def model() -> AsyncIterator[FakeServer]:
    server = FakeServer(slots=4, n_ctx=4096)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


TOKEN = "test-token-pg"


def _client(daemon: Daemon) -> TestClient[Any, Any]:
    app = create_app(daemon, HttpOptions(token=TOKEN))
    return TestClient(TestServer(app), headers={"Authorization": f"Bearer {TOKEN}"})


async def _daemon(tmp_path: Path, name: str, dsn: str, url: str) -> Daemon:
    d = Daemon(settings_for(tmp_path / name, roster_toml(url), ledger_url=dsn))
    await d.start()
    return d


async def test_database_down_mid_load_is_503_and_degraded_then_resumes(
    pg_server: Server, pg_dsn: str, tmp_path: Path, model: FakeServer
) -> None:
    (tmp_path / "one").mkdir()
    daemon = await _daemon(tmp_path, "one", pg_dsn, model.url)
    client = _client(daemon)
    await client.start_server()
    acked: dict[int, str] = {}
    refused: list[LedgerUnwritable] = []
    stop = asyncio.Event()

    async def writer(n: int) -> None:
        while not stop.is_set():
            try:
                e = await daemon.ledger.append(actor=f"w{n}", kind="load", body={"n": n})
            except LedgerUnwritable as err:
                refused.append(err)
                await asyncio.sleep(0.05)
                continue
            acked[e.seq] = e.hash

    try:
        tasks = [asyncio.create_task(writer(n)) for n in range(64)]
        while len(acked) < 200:
            await asyncio.sleep(0.01)
        await asyncio.to_thread(pg_server.stop, "fast")
        try:
            while not refused:
                await asyncio.sleep(0.02)
            health = await (await client.post("/v1/tools/health", json={})).json()
            assert health["status"] == "degraded"
            assert not health["ledger_writable"]
            assert "shared record at postgresql://" in health["reason"], health["reason"]
            assert "is unreachable" in health["reason"]
            # A surface's append: a clean 503 with Retry-After, no traceback.
            r = await client.post(
                "/v1/tools/ledger_redact", json={"body_hash": "0" * 64, "reason": "outage"}
            )
            assert r.status == 503, await r.text()
            assert "Retry-After" in r.headers
            assert refused[0].status == 503
            during = len(acked)
        finally:
            await asyncio.to_thread(pg_server.start)
        deadline = time.monotonic() + 30
        while len(acked) < during + 200 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert len(acked) >= during + 200, "appends did not resume"
        health = await (await client.post("/v1/tools/health", json={})).json()
        assert health["status"] == "ok"
        stop.set()
        await asyncio.gather(*tasks)
    finally:
        stop.set()
        await client.close()
        await daemon.stop()
    lines, _ = record_lines(pg_dsn)
    check_chain(lines)
    for seq, leaf in acked.items():
        assert rfc9162._h(b"\x00" + lines[seq]).hex() == leaf, seq


async def test_export_redaction_and_runs_of_all_daemons(
    pg_dsn: str, tmp_path: Path, model: FakeServer
) -> None:
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    a = await _daemon(tmp_path, "a", pg_dsn, model.url)
    b = await _daemon(tmp_path, "b", pg_dsn, model.url)
    try:
        secret = await a.ledger.append(actor="t", kind="note", body={"secret": "s3cr3t"})
        kept = await b.ledger.append(actor="t", kind="note", body={"kept": 1})
        assert secret.body is not None
        assert kept.body is not None
        redaction = await b.ledger.redact(secret.body, actor="admin", reason="leaked")
        assert (await a.ledger.body(secret.body)).state == "redacted"
        assert (await a.ledger.body(kept.body)).value == {"kept": 1}
        with pytest.raises(NotFound):
            await a.ledger.redact("ab" * 32, actor="admin", reason="nothing there")
        # A run on daemon a: b lists it with --all, and only then.
        client = _client(a)
        await client.start_server()
        try:
            r = await client.post("/v1/tools/submit", json={"request": "write the api"})
            assert r.status == 200, await r.text()
            run_id = (await r.json())["id"]
        finally:
            await client.close()
        for d in (a, b):
            await d.ledger.checkpoint()
        b_client = _client(b)
        await b_client.start_server()
        try:
            await b.ledger.refresh()  # type: ignore[attr-defined]
            mine = await (await b_client.post("/v1/tools/runs_list", json={})).json()
            assert run_id not in {r["id"] for r in mine["runs"]}
            every = await (await b_client.post("/v1/tools/runs_list", json={"all": True})).json()
            assert run_id in {r["id"] for r in every["runs"]}
            assert every["daemons"][run_id] == a.ledger.name  # type: ignore[attr-defined]
        finally:
            await b_client.close()
    finally:
        await a.stop()
        await b.stop()
    code, said, _ = await cli("ledger", "verify", "--deep", "--ledger", pg_dsn)
    assert code == 0, said
    assert "1 redacted, 0 tampered" in said, said
    # Deep verify reads every body of the shared record against its kind's schema too: the
    # run's, both daemons' ledger.join; a test's own `note` is not tally's vocabulary.
    code, said, _ = await cli("ledger", "verify", "--deep", "--json", "--ledger", pg_dsn)
    assert code == 0, said
    schemas = json.loads(said)["checked"]["schemas"]
    assert schemas["mismatches"] == 0, schemas
    assert schemas["checked"] >= 10, schemas
    assert schemas["unknown"] == {"note": 2}, schemas  # counted, never checked
    out = tmp_path / "export"
    code, said, err = await cli("ledger", "export", str(out), "--ledger", pg_dsn)
    assert code == 0, said + err
    # The file ledger's own verifier, on the export as on a state dir.
    code, said, err = await cli("ledger", "verify", "--deep", "--state", str(out))
    assert code == 0, said + err
    assert "1 redacted, 0 tampered" in said, said
    assert "signature valid" in said, said
    lines = (out / "ledger" / "entries.jsonl").read_bytes().split(b"\n")[:-1]
    assert lines == record_lines(pg_dsn)[0]
    assert Entry.from_line(lines[redaction.seq]).kind == "redaction"
    assert b"s3cr3t" not in (out / "ledger" / "bodies.pack").read_bytes()
    # A body removed behind the record's back is tampered, not redacted.
    with psycopg.connect(pg_dsn) as conn:
        conn.execute(
            "UPDATE tally_bodies SET data = NULL, redacted_at = 1 WHERE digest = %s",
            (bytes.fromhex(kept.body),),
        )
    code, said, _ = await cli("ledger", "verify", "--deep", "--ledger", pg_dsn)
    assert code == 1, said
    assert kept.body in said, said


async def test_ledger_url_must_be_postgresql() -> None:
    code, _, err = await cli("ledger", "verify", "--ledger", "mysql://x/y")
    assert code == 2, err
    assert "postgresql://" in err, err


def test_a_shown_url_never_carries_its_password() -> None:
    from daemon.ledger.postgres import shown_dsn

    shown = shown_dsn("postgresql://tally:s3cret@db.example:5433/record?sslmode=require")
    assert shown == "postgresql://tally@db.example/record"
    assert "s3cret" not in shown_dsn("postgresql://tally:s3cret@/x?host=/tmp/sock")


@pytest.mark.parametrize(
    "url",
    [
        "postgresql://tally:s3cr%zzet@127.0.0.1/x",  # a bad %-escape: libpq quotes the token
        "postgresql://tally:s3cret@[::1:5432/x",  # an unclosed [: libpq quotes the whole URI
        "postgresql://tally:s3cr%41et@[::1/x",  # the same, %-encoded
        "postgresql://tally@[::1/x?password=s3cret",
    ],
)
async def test_an_unparsable_ledger_url_never_shows_its_password(url: str) -> None:
    code, out, err = await cli("ledger", "verify", "--ledger", url)
    assert code != 0
    said = out + err
    assert "cannot open the shared record" in said, said
    for secret in ("s3cr", "%41"):
        assert secret not in said, said


async def test_reading_a_database_without_a_record_refuses_and_creates_nothing(
    pg_dsn: str,
) -> None:
    """A read-only command on a wrong or empty database says so and runs no DDL."""
    code, out, err = await cli("ledger", "verify", "--ledger", pg_dsn)
    assert code == 1, out + err
    assert "no tally record in this database" in out + err
    with psycopg.connect(pg_dsn) as conn:
        found = conn.execute(
            "SELECT count(*) FROM pg_tables WHERE tablename LIKE 'tally_%'"
        ).fetchone()
    assert found == (0,)


async def test_serve_with_a_wrong_ledger_url_names_its_scheme_not_its_password(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # pydantic's error once printed the whole URL (`input_value='mysql://u:s3cret@…'`).
    where = ["--state", str(tmp_path / "state"), "--socket", str(tmp_path / "s.sock")]
    code, out, err = await cli("serve", *where, "--ledger", "mysql://u:s3cret@h/db")
    assert code == 2, out + err
    assert "names 'mysql', not a PostgreSQL URL" in err, err
    assert "s3cret" not in out + err
    monkeypatch.setenv("TALLY_LEDGER", "mysql://u:s3cret@h/db")
    code, out, err = await cli("serve", *where)
    assert code == 2, out + err
    assert "s3cret" not in out + err
