"""The shared record's stored Merkle nodes (`tally_nodes`): a daemon opens on the frontier's
nodes, not every leaf; proofs read the nodes they need and are refused, never served wrong,
when one is damaged; verify names a wrong node; a record made before the table is migrated."""

from __future__ import annotations

import asyncio
from pathlib import Path

import psycopg
import pytest

from daemon.ledger import LedgerCorrupt, LedgerFailed
from daemon.ledger.audit import DERIVED
from daemon.ledger.merkle import verify_consistency
from daemon.ledger.postgres import frontier_coords
from daemon.ledger.shared import SharedLedger
from tests.ledger import rfc9162

N = 300  # not a power of two: the frontier has several nodes (256 + 32 + 8 + 4)


async def _filled(dsn: str, state: Path, n: int = N) -> SharedLedger:
    ledger = await SharedLedger.open_shared(dsn, state, checkpoint_interval=None)

    async def writer(k: int) -> None:
        for i in range(n // 10):
            await ledger.append(actor=f"w{k}", kind="note", body={"i": i, "k": k})

    await asyncio.gather(*(writer(k) for k in range(10)))
    return ledger


def _lines(dsn: str) -> list[bytes]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT line FROM tally_entries ORDER BY seq").fetchall()
    return [bytes(line) for (line,) in rows]


async def test_a_daemon_opens_on_the_frontier_nodes_alone(pg_dsn: str, tmp_path: Path) -> None:
    """With every leaf hash but the frontier's zeroed in the table, a new daemon still opens
    at the right root: it never read them. Verify (the walk) finds them."""
    first = await _filled(pg_dsn, tmp_path / "a")
    size, root = first.size, first.root()
    await first.close()
    assert root == rfc9162.mth(_lines(pg_dsn)).hex()
    kept = [index for level, index in frontier_coords(size) if level == 0]
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute(
            "UPDATE tally_entries SET leaf = %s WHERE NOT seq = ANY(%s)", (bytes(32), kept)
        )
    reader = await SharedLedger.open_shared(pg_dsn, None, readonly=True)
    try:
        assert (reader.size, reader.root()) == (size, root)
        report = await reader.verify()
        assert not report.ok, report
        assert report.first_bad_seq == 0, report
    finally:
        await reader.close()


async def test_proofs_read_stored_nodes_and_a_wrong_one_is_refused_and_named(
    pg_dsn: str, tmp_path: Path
) -> None:
    ledger = await _filled(pg_dsn, tmp_path / "a")
    try:
        lines = _lines(pg_dsn)
        size = ledger.size
        root = bytes.fromhex(ledger.root())
        assert root == rfc9162.mth(lines)
        for seq in (0, 1, 127, 255, 256, size - 1):
            proof = await ledger.inclusion_proof(seq)
            path = [bytes.fromhex(p) for p in proof.path]
            assert rfc9162.verify_inclusion(seq, size, lines[seq], path, root), seq
        for old in (1, 100, 256, size - 1):
            cons = await ledger.consistency_proof(old)
            cpath = [bytes.fromhex(p) for p in cons.path]
            assert bytes.fromhex(cons.old_root) == rfc9162.mth(lines[:old])
            assert verify_consistency(old, size, bytes.fromhex(cons.old_root), root, cpath)
        assert (await ledger.verify()).ok
        # a stored node damaged (level 3, index 2: leaves 16..23), and the cache forgotten
        with psycopg.connect(pg_dsn, autocommit=True) as conn:
            conn.execute(
                "UPDATE tally_nodes SET hash = %s WHERE level = 3 AND idx = 2", (b"x" * 32,)
            )
        ledger._nodes.clear()
        with pytest.raises(LedgerCorrupt):
            await ledger.inclusion_proof(24)  # its path holds that node
        report = await ledger.verify()
        assert not report.ok, report
        assert report.reason == DERIVED, report
        assert report.derived == [
            "tally_nodes: the node at level 3, index 2 is not the leaves' hash"
        ]
    finally:
        await ledger.close()


async def test_a_record_made_before_stored_nodes_is_migrated_by_a_daemon(
    pg_dsn: str, tmp_path: Path
) -> None:
    first = await _filled(pg_dsn, tmp_path / "a")
    size, root = first.size, first.root()
    await first.close()
    with psycopg.connect(pg_dsn, autocommit=True) as conn:
        conn.execute("DROP TABLE tally_nodes")  # the schema as it was
    reader = await SharedLedger.open_shared(pg_dsn, None, readonly=True)
    try:  # a reader changes nothing: it reads and verifies, and serves no proof
        assert (reader.size, reader.root()) == (size, root)
        assert (await reader.verify(deep=True)).ok
        with pytest.raises(LedgerFailed, match="start a daemon on it once"):
            await reader.inclusion_proof(3)
    finally:
        await reader.close()
    with psycopg.connect(pg_dsn) as conn:
        assert conn.execute("SELECT to_regclass('tally_nodes')").fetchone() == (None,)
    again = await SharedLedger.open_shared(pg_dsn, tmp_path / "a", checkpoint_interval=None)
    try:
        assert (again.size, again.root()) == (size, root)
        await again.append(actor="t", kind="note", body={"after": 1})
        lines = _lines(pg_dsn)
        assert again.root() == rfc9162.mth(lines).hex()
        proof = await again.inclusion_proof(7)
        path = [bytes.fromhex(p) for p in proof.path]
        assert rfc9162.verify_inclusion(7, len(lines), lines[7], path, rfc9162.mth(lines))
        assert (await again.verify()).ok
    finally:
        await again.close()
