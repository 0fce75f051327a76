"""A ledger whose record lives on PostgreSQL, shared by several daemons (`--ledger postgresql://…`).

`SharedLedger` is the ledger with another storage under it: the group commit (`WriterThread`,
`Writer._commit_batch`, `_settle`), the encoding of lines (`encode_batch`), outages and their
probe, the redaction checks, the reads (body states, entry filters) and the proofs (checked
against the head before they are served) are the ledger's own, in `writer` and `reader`. This
module is the PostgreSQL implementation of the storage operations they call (the `Storage`
protocol in `daemon.ledger.storage`): commit a batch at the expected head, read lines, bodies
and Merkle nodes, probe, checkpoint; the tables, and what reads them without a daemon (verify,
export), are in `postgres`. Everything here that talks to the database is blocking (psycopg's
synchronous driver) and runs where the file storage's I/O runs: commits, probes, follows and
checkpoints on the writer thread, reads in worker threads (a small connection pool). One piece
(past 500 lines): it is one storage, whose writes, reads and proofs share the frontier this
daemon knows and the connections.

The record is the file ledger's, byte for byte: the same canonical lines (built by the same
`encode_batch`), RFC 9162 leaf hashes, bodies hashed the same way, C2SP checkpoint notes.
What differs is where it is kept and:
- Several daemons append. Each group-commits its own appends (the writer thread takes what is
  queued as the next batch). Seq and `prev` come from the head row under its lock, so two
  daemons never fork the chain: where the daemon knows the head (it wrote last, or caught up
  since), the batch is one statement that moves the head only if it is still there, and writes
  nothing otherwise (`WRITE`); else a transaction locks the head row (`SELECT … FOR UPDATE`),
  reads the size and last leaf hash there and writes on them. Every commit is durable before
  it returns (`synchronous_commit = on`); only then are the appends acknowledged. Each row
  names the daemon that wrote it (its checkpoint key's name), and a daemon's first write is a
  `ledger.join` entry witnessing its name and key.
- The Merkle tree is stored (`tally_nodes`, written by the statement that writes the entries
  completing them). A daemon holds only the frontier (O(log n) hashes): it opens, and catches
  up with other daemons' appends, by reading the frontier's nodes at the head's size; a proof
  reads the nodes it needs in one round trip (`_subtree_for`), and is checked against the
  frontier's root like a file ledger's. A follower task catches up every `FOLLOW_S`. Reads
  see `size`: the entries this daemon knows are committed.
- The database unreachable (a restart, the network): the batch fails with 503 (nothing of it
  was acknowledged), health says `degraded` (reason `database_unreachable`), and the probe
  reconnects with backoff; appends resume once it answers. A commit whose outcome was lost
  with the connection is not acknowledged; if it did commit, its entries are in the record
  like any others (as a file ledger's unacknowledged batch may survive a crash whole).
- Runs stay per daemon: replay (`entries(in_run=True)` with no run named) reads only this
  daemon's entries, so a restarting daemon rebuilds and interrupts only its own runs.
  `foreign_runs` lists the others' runs (for `runs_list --all`).
- Redaction: the `redaction` entry and the body's removal commit in one transaction.
- Checkpoints: signed by this daemon's key (its state dir's, as for a file ledger) and stored
  in `tally_checkpoints`; the other daemons cosign them (`Cosigner.cosign_shared`) into
  `tally_cosignatures`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from daemon.errors import Unavailable
from daemon.ledger.audit import VerifyReport
from daemon.ledger.checkpoint import Checkpoint, parse_note
from daemon.ledger.entry import Entry
from daemon.ledger.errors import LedgerCorrupt, LedgerFailed, LedgerUnwritable
from daemon.ledger.log import Ledger
from daemon.ledger.merkle import Frontier, Subtree, leaf_hash, node_hash, split_point
from daemon.ledger.outage import Outage, Unreachable
from daemon.ledger.postgres import (
    BATCH_ROWS,
    checkpoints,
    connect,
    daemons,
    ensure_schema,
    export_record,
    frontier_at,
    frontier_coords,
    indexed_nodes,
    joined_keys,
    latest_cosigned,
    latest_note,
    read_nodes,
    scrub,
    shown_dsn,
    store_cosignature,
    uncosigned,
    verify_record,
    with_cosignatures,
)
from daemon.ledger.reader import EntryFilter
from daemon.ledger.writer import _Pending, _Stalled, encode_batch
from daemon.record.ledger import LedgerJoin

log = logging.getLogger(__name__)

WRITE = """
WITH moved AS (
    UPDATE tally_head SET size = %(size)s, last_hash = %(last)s, last_ts = %(ts)s
    WHERE size = %(was_size)s AND last_hash = %(was_last)s
    RETURNING 1
), bodies AS (
    INSERT INTO tally_bodies (digest, length, data)
    SELECT b.* FROM unnest(%(digests)s::bytea[], %(lengths)s::integer[], %(datas)s::bytea[]) AS b,
        moved
    ON CONFLICT (digest) DO UPDATE SET data = EXCLUDED.data, redacted_at = NULL
        WHERE tally_bodies.data IS NULL
), entries AS (
    INSERT INTO tally_entries (seq, line, leaf, kind, run, actor, body, daemon)
    SELECT e.*, %(daemon)s FROM unnest(
        %(seqs)s::bigint[], %(lines)s::bytea[], %(leaves)s::bytea[], %(kinds)s::text[],
        %(runs)s::text[], %(actors)s::text[], %(bodies)s::bytea[]
    ) AS e, moved
), nodes AS (
    INSERT INTO tally_nodes (level, idx, hash)
    SELECT n.* FROM unnest(%(node_levels)s::smallint[], %(node_idxs)s::bigint[],
        %(node_hashes)s::bytea[]) AS n, moved
)
SELECT count(*) FROM moved
"""
"""A batch's bodies, entries, the Merkle nodes they complete and the new head, as one
statement, written only if the head is still where the batch was built on: the UPDATE takes the
head row's lock and, if another daemon moved the head meanwhile, re-checks its condition on the
committed row and matches nothing, so nothing is written (one chain, whatever the timing)."""

FOLLOW_S = 0.5
"""How often a daemon reads the head for entries other daemons appended."""
UNREACHABLE = Unreachable.REASON
READ_TIMEOUT = 5.0
NODE_CACHE = 1 << 16
"""Stored nodes kept in memory (they never change once written): a proof's upper levels are
shared by every proof, so most proofs read only a few low nodes."""

_T = TypeVar("_T")
_ZERO = bytes(32)


@dataclass(slots=True)
class _Built:
    entries: list[Entry]
    redactions: list[tuple[int, bytes]]
    params: dict[str, Any]
    frontier: Frontier
    last: str
    ts: int


class SharedLedger(Ledger):
    """Open with `await SharedLedger.open_shared(dsn, state_dir)` (module doc)."""

    _outage_ends = "the database answers again"

    def __init__(self, dsn: str, state_dir: Path | None, readonly: bool) -> None:
        super().__init__(
            state_dir if state_dir is not None else Path("/nonexistent/tally"), readonly
        )
        self.dsn = dsn
        self.shared = True
        self.name = ""
        """This daemon's name in the record: its checkpoint key's name."""
        self._conn: Any = None  # the writer thread's connection
        self._pool: Any = None  # readers' (worker threads)
        self._frontier = Frontier()  # writer thread: the tree as far as this daemon knows it
        self._head_hash: str | None = None  # the head's last hash, where this daemon knows it
        self._has_nodes = True  # False: a reader of a record made before `tally_nodes`
        self._nodes: dict[tuple[int, int], bytes] = {}  # stored nodes read (see NODE_CACHE)
        self._follower: asyncio.Task[None] | None = None

    @classmethod
    async def open_shared(
        cls,
        dsn: str,
        state_dir: Path | None,
        *,
        readonly: bool = False,
        checkpoint_interval: float | None = 60.0,
    ) -> SharedLedger:
        """Connect, create the tables if missing, read the head and its frontier; the owner
        also loads its key (from `state_dir/ledger`) and joins the record. Raises `Unavailable`
        (naming the database, never its password) when it cannot be reached."""
        ledger = cls(dsn, state_dir, readonly)
        ledger._loop = asyncio.get_running_loop()
        try:
            await ledger._start(checkpoint_interval)
        except BaseException:
            await ledger._drop()
            raise
        return ledger

    async def _start(self, checkpoint_interval: float | None) -> None:
        import psycopg
        from psycopg_pool import ConnectionPool

        loop = self._loop
        try:
            await loop.run_in_executor(self._executor, self._connect)
        except psycopg.Error as err:
            raise Unavailable(
                f"cannot open the shared record at {shown_dsn(self.dsn)}: {_said(err, self.dsn)}"
            ) from err
        except LookupError as err:
            raise Unavailable(f"{shown_dsn(self.dsn)}: {scrub(str(err), self.dsn)}") from err
        self._size = self._frontier.size
        self._pool = ConnectionPool(
            self.dsn,
            min_size=1,
            max_size=4,
            open=False,
            timeout=READ_TIMEOUT,
            kwargs={"autocommit": True},
            configure=_durable,
        )
        await asyncio.to_thread(self._pool.open, wait=True, timeout=READ_TIMEOUT)
        if self.readonly:
            found = latest_note(await self._ask(checkpoints))
            if found is not None:
                self._latest = parse_note(found[1])
                self._vkey = (await self._ask(daemons)).get(found[0])
            return
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        # One daemon per state dir (its key names it in the record), as for a file ledger.
        await asyncio.to_thread(self._take_lock)
        signer = await asyncio.to_thread(self._signer_now)
        self.name = signer.name
        row = await self._ask(
            lambda conn: conn.execute(
                "SELECT size, note FROM tally_checkpoints WHERE daemon = %s "
                "ORDER BY size DESC LIMIT 1",
                (self.name,),
            ).fetchone()
        )
        if row is not None:
            self._latest = parse_note(row[1])
        await self._join(signer.vkey)
        self._follower = asyncio.create_task(self._follow_loop(), name="shared-ledger-follow")
        if checkpoint_interval:
            self._ticker = asyncio.create_task(
                self._tick(checkpoint_interval), name="ledger-checkpoints"
            )

    def _signer_now(self) -> Any:
        from daemon.ledger.checkpoint import SignerOnDemand

        self._signer = SignerOnDemand(self.dir)
        return self._signer.get()

    def _connect(self) -> None:
        """Writer thread: connect, make sure of the tables, read the head and its frontier."""
        self._conn = connect(self.dsn)
        self._has_nodes = ensure_schema(self._conn, self.readonly)  # a reader never runs DDL
        self._follow_head()

    async def _join(self, vkey: str) -> None:
        """Register this daemon's key, and witness it with a `ledger.join` entry (once)."""
        inserted = await self._ask(
            lambda conn: conn.execute(
                "INSERT INTO tally_daemons (name, vkey) VALUES (%s, %s) "
                "ON CONFLICT (name) DO NOTHING RETURNING name",
                (self.name, vkey),
            ).fetchone()
        )
        if inserted is None:
            return
        joined = LedgerJoin(daemon=self.name, vkey=vkey)
        entry = await self.append(actor="ledger", kind=joined.KIND, body=joined.written())
        await self._ask(
            lambda conn: conn.execute(
                "UPDATE tally_daemons SET joined_seq = %s WHERE name = %s", (entry.seq, self.name)
            )
        )

    # ---- the storage's writes (writer thread) ----

    def _commit(self, batch: list[_Pending]) -> list[Entry]:
        """Writer thread: commit a batch durably, or raise `_Stalled` (the database did not
        answer: nothing was acknowledged) or `LedgerFailed` (the record cannot be extended)."""
        import psycopg

        t0 = time.perf_counter()
        try:
            entries = self._transact(batch)
        except (psycopg.Error, OSError) as err:
            self._write_failures += 1
            self._disconnect()
            down = Unreachable(self._unreachable(err))
            raise _Stalled(Outage.of(down), None) from err
        self._stats.observe(time.perf_counter() - t0)
        self._stats.appends += len(batch)
        self._stats.batches += 1
        return entries

    def _transact(self, batch: list[_Pending]) -> list[Entry]:
        """Where this daemon knows the head (it wrote last, or has caught up since), the batch
        is one autocommit statement conditional on that head (`WRITE`): one round trip.
        Otherwise, or if another daemon moved the head first, or for a redaction, one
        transaction locks the head row (`SELECT … FOR UPDATE`), reads the frontier at that
        size from the stored nodes, and writes on that head."""
        conn = self._writer()
        ts = max(time.time_ns() // 1000, self._last_ts)
        head = self._head_hash
        if head is not None and all(p.redacts is None for p in batch):
            built = self._build(batch, self._frontier, head, ts)
            self._head_hash = None  # unknown until the answer: a lost one leaves it so
            if conn.execute(WRITE, built.params).fetchone()[0] == 1:
                return self._committed(built)
        with conn.transaction():
            row = conn.execute("SELECT size, last_hash, last_ts FROM tally_head FOR UPDATE")
            size, prev, last_ts = row.fetchone()
            built = self._build(batch, self._frontier_on(conn, size), prev, max(ts, last_ts))
            if conn.execute(WRITE, built.params).fetchone()[0] != 1:
                raise LedgerFailed("the record's head moved under its lock")
            for at, digest in built.redactions:  # after: a statement changes a row once
                conn.execute(
                    "UPDATE tally_bodies SET data = NULL, redacted_at = %s WHERE digest = %s",
                    (at, digest),
                )
        return self._committed(built)

    def _committed(self, built: _Built) -> list[Entry]:
        """Committed (durable: synchronous_commit = on): the frontier moves, then the acks."""
        self._publish(built.frontier)
        self._last_ts = built.ts
        self._head_hash = built.last
        return built.entries

    def _build(self, batch: list[_Pending], frontier: Frontier, prev: str, ts: int) -> _Built:
        """The batch's lines on the head (`encode_batch`), the nodes they complete, and the
        statement's parameters."""
        enc = encode_batch(batch, frontier.size, prev, ts)
        grown = frontier.copy()
        nodes = indexed_nodes(grown, enc.leaves)
        bodies: dict[bytes, bytes] = {}
        for p in batch:
            if p.digest is not None and p.body is not None:
                bodies.setdefault(p.digest, p.body)
        params = {
            "size": grown.size,
            "last": enc.prev,
            "ts": ts,
            "was_size": frontier.size,
            "was_last": prev,
            "digests": list(bodies),
            "lengths": [len(b) for b in bodies.values()],
            "datas": list(bodies.values()),
            "daemon": self.name,
            "seqs": [e.seq for e in enc.entries],
            "lines": enc.lines,
            "leaves": enc.leaves,
            "kinds": [p.kind for p in batch],
            "runs": [p.run for p in batch],
            "actors": [p.actor for p in batch],
            "bodies": [p.digest for p in batch],
            "node_levels": [n[0] for n in nodes],
            "node_idxs": [n[1] for n in nodes],
            "node_hashes": [n[2] for n in nodes],
        }
        return _Built(enc.entries, enc.redactions, params, grown, enc.prev, ts)

    def _frontier_on(self, conn: Any, size: int) -> Frontier:
        """Writer thread: the frontier at the record's `size` (never smaller than what this
        daemon saw): its own where it has not moved, else read from the stored nodes."""
        have = self._frontier.size
        if size < have:
            raise LedgerFailed(
                f"the shared record shrank: it holds {size} entries, this daemon saw {have} "
                "(a database restored from an older backup?); stop every daemon and check it "
                "with `tally ledger verify --ledger …`"
            )
        if size == have:
            return self._frontier
        if not self._has_nodes:  # a reader of a record made before `tally_nodes`
            frontier = self._frontier.copy()
            for leaves in _leaf_blocks(conn, have, size):
                frontier.push_many(leaves)
            return frontier
        try:
            return frontier_at(conn, size)
        except LookupError as err:
            raise LedgerFailed(f"{err}: check it with `tally ledger verify --ledger …`") from err

    def _publish(self, frontier: Frontier) -> None:
        """Writer thread: readers check proofs against this frontier from now on."""
        self._frontier = frontier
        self._head = frontier.snapshot()
        if not self._has_nodes:  # a reader of an old record: its frontier's nodes alone
            hashes = [h for _, h in self._head[1]]
            self._nodes = dict(zip(frontier_coords(frontier.size), hashes, strict=True))

    def _follow_head(self) -> int:
        """Writer thread: catch up with the entries other daemons appended; the new size."""
        conn = self._writer()
        size, last_hash, last_ts = conn.execute(
            "SELECT size, last_hash, last_ts FROM tally_head"
        ).fetchone()
        self._publish(self._frontier_on(conn, size))
        self._last_ts = max(self._last_ts, last_ts)
        self._head_hash = last_hash
        return self._frontier.size

    def _writer(self) -> Any:
        if self._conn is None or self._conn.closed:
            self._conn = connect(self.dsn)
        return self._conn

    def _disconnect(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                self._conn.close()
        self._conn = None

    def _probe(self, outage: Outage) -> None:
        """Writer thread (the ledger's probe): reconnect and catch up; raises `Unreachable`
        while the database does not answer."""
        import psycopg

        self._disconnect()
        try:
            self._follow_head()
        except psycopg.Error as err:
            self._disconnect()
            raise Unreachable(self._unreachable(err)) from err
        self._halted = None

    def _checkpoint(self) -> Checkpoint:
        """Writer thread: sign the tree this daemon knows (every entry in it committed) and
        store the note."""
        import psycopg

        assert self._signer is not None
        if self._failed is not None:
            raise self._failed
        frontier = self._frontier
        checkpoint = self._signer.get().sign(
            frontier.size, frontier.root(), max(time.time_ns() // 1000, self._last_ts)
        )
        try:
            self._writer().execute(
                "INSERT INTO tally_checkpoints (daemon, size, root, note) "
                "VALUES (%s, %s, %s, %s) ON CONFLICT (daemon, size) DO UPDATE "
                "SET note = EXCLUDED.note, root = EXCLUDED.root, signed_at = now()",
                (self.name, frontier.size, bytes.fromhex(checkpoint.root), checkpoint.note),
            )
        except psycopg.Error as err:
            self._disconnect()
            raise Unreachable(self._unreachable(err)) from err
        return checkpoint

    def _unreachable(self, err: BaseException) -> str:
        return f"the shared record at {shown_dsn(self.dsn)} is unreachable: {_said(err, self.dsn)}"

    async def _follow_loop(self) -> None:
        """Every `FOLLOW_S`, catch up with the other daemons' appends (a job between
        batches); a failure is left to the next append to find (and begin an outage)."""
        loop = asyncio.get_running_loop()
        while not self._closed:
            await asyncio.sleep(FOLLOW_S)
            if self._outage is not None or self._failed is not None:
                continue
            try:
                size = await loop.run_in_executor(self._executor, self._follow_head)
            except Exception as err:
                log.debug("ledger: following the shared record failed: %s", err)
                continue
            self._size = max(self._size, size)

    async def refresh(self) -> int:
        """Catch up with the entries other daemons appended; the new size."""
        size = await self._loop.run_in_executor(self._executor, self._follow_head)
        self._size = max(self._size, size)
        return self._size

    # ---- redaction: the body goes in the entry's own transaction (`_transact`) ----

    def _has_body(self, digest: bytes) -> bool:
        return self._query(
            lambda conn: (
                conn.execute("SELECT 1 FROM tally_bodies WHERE digest = %s", (digest,)).fetchone()
                is not None
            )
        )

    async def _after_redaction(self, entry: Entry, digest: bytes) -> None:
        return None

    # ---- the storage's reads (worker threads) ----

    def _query(self, fn: Callable[[Any], _T]) -> _T:
        """Run `fn` on a reader's connection; an unreachable database is a 503 naming it."""
        import psycopg
        from psycopg_pool import PoolTimeout

        try:
            with self._pool.connection() as conn:
                return fn(conn)
        except (psycopg.OperationalError, PoolTimeout) as err:
            raise LedgerUnwritable(
                UNREACHABLE, _said(err, self.dsn), 1.0, what="the shared record cannot be read now"
            ) from err

    async def _ask(self, fn: Callable[[Any], _T]) -> _T:
        return await asyncio.to_thread(self._query, fn)

    def _read_entry(self, seq: int) -> Entry:
        row = self._query(
            lambda conn: conn.execute(
                "SELECT line FROM tally_entries WHERE seq = %s", (seq,)
            ).fetchone()
        )
        if row is None:
            raise LedgerCorrupt(seq, f"entry {seq} is missing from the shared record")
        return Entry.from_line(bytes(row[0]))

    def _stored_bodies(self, digests: list[bytes]) -> dict[bytes, tuple[bytes | None, bool]]:
        if not digests:
            return {}
        found = self._query(
            lambda conn: conn.execute(
                "SELECT digest, data, redacted_at FROM tally_bodies WHERE digest = ANY(%s)",
                (digests,),
            ).fetchall()
        )
        return {
            bytes(d): (None if data is None else bytes(data), data is None and at is not None)
            for d, data, at in found
        }

    def _scan(self, start: int, size: int, limit: int, wanted: EntryFilter) -> list[Entry]:
        """`wanted` as a WHERE clause; `in_run` with no run named reads this daemon's entries
        only (replay: runs stay per daemon, see the module doc)."""
        where = ["seq >= %s", "seq < %s"]
        params: list[Any] = [start, size]
        for column, value in wanted.fields():
            where.append(f"{column} = %s")
            params.append(value)
        if wanted.in_run:
            where.append("run IS NOT NULL")
            if wanted.run is None and not self.readonly:
                where.append("daemon = %s")
                params.append(self.name)
        params.append(limit)
        query = f"SELECT line FROM tally_entries WHERE {' AND '.join(where)} ORDER BY seq LIMIT %s"
        found = self._query(lambda conn: conn.execute(query, params).fetchall())
        return [Entry.from_line(bytes(line)) for (line,) in found]

    def _record_leaf(self, seq: int) -> bytes:
        row = self._query(
            lambda conn: conn.execute(
                "SELECT line FROM tally_entries WHERE seq = %s", (seq,)
            ).fetchone()
        )
        if row is None:
            raise LedgerCorrupt(seq, f"entry {seq} is missing from the shared record")
        return leaf_hash(bytes(row[0]))

    def _subtree_for(self, plan: Callable[[Subtree], object]) -> Subtree:
        """The nodes `plan` reads, fetched in one round trip (those not cached yet)."""
        cache = self._nodes
        need: set[tuple[int, int]] = set()

        def record(start: int, end: int) -> bytes:
            n = end - start
            if n & (n - 1) == 0 and start % n == 0:
                coord = (n.bit_length() - 1, start // n)
                if coord not in cache:
                    need.add(coord)
                return _ZERO
            k = split_point(n)
            record(start, start + k)
            record(start + k, end)
            return _ZERO

        plan(record)
        if need and not self._has_nodes:
            raise LedgerFailed(
                "this shared record was made before tally stored its Merkle nodes: start a "
                "daemon on it once (it adds them); verify and export work meanwhile"
            )
        if need:
            found = self._query(lambda conn: read_nodes(conn, need))
            if len(cache) + len(found) > NODE_CACHE:
                cache.clear()
            cache.update(found)
            missing = need - found.keys()
        else:
            found, missing = {}, set()

        def subtree(start: int, end: int) -> bytes:
            n = end - start
            if n & (n - 1) == 0 and start % n == 0:
                coord = (n.bit_length() - 1, start // n)
                digest = found.get(coord) or cache.get(coord)
                if digest is None or coord in missing:
                    raise LedgerCorrupt(
                        start,
                        f"the shared record lacks its stored Merkle node at level {coord[0]}, "
                        f"index {coord[1]} (`tally ledger verify --ledger …` checks them)",
                    )
                return digest
            k = split_point(n)
            return node_hash(subtree(start, start + k), subtree(start + k, end))

        return subtree

    def _rebuild_tree(self) -> int:
        """A proof did not check: forget the cached nodes (the next proof reads them again);
        the stored ones are the record's to repair (`verify` names a wrong one)."""
        self._nodes.clear()
        return 0

    async def verify(self, deep: bool = False) -> VerifyReport:
        return await self._ask(lambda conn: verify_record(conn, deep))

    async def export(self, target: Path) -> dict[str, Any]:
        return await self._ask(lambda conn: export_record(conn, target))

    async def writers(self, seqs: Sequence[int]) -> dict[int, str]:
        """Which daemon wrote each of these entries."""
        found = await self._ask(
            lambda conn: conn.execute(
                "SELECT seq, daemon FROM tally_entries WHERE seq = ANY(%s)", (list(seqs),)
            ).fetchall()
        )
        return {int(s): d for s, d in found}

    async def foreign_runs(self, limit: int) -> list[tuple[str, str]]:
        """(run id, daemon) of the newest runs other daemons started, newest first."""
        found = await self._ask(
            lambda conn: conn.execute(
                "SELECT run, daemon FROM tally_entries WHERE kind = 'run.request' "
                "AND run IS NOT NULL AND daemon <> %s AND seq < %s ORDER BY seq DESC LIMIT %s",
                (self.name, self._size, limit),
            ).fetchall()
        )
        return [(r, d) for r, d in found]

    @property
    def record_note(self) -> str | None:
        return None

    # ---- cosignatures (`daemon.cosigning.Cosigner.cosign_shared`) ----

    async def joined_keys(self) -> dict[str, str]:
        """Every daemon's key, as its `ledger.join` entry in the record witnesses it."""
        return await self._ask(joined_keys)

    async def uncosigned(self) -> list[tuple[str, int, str]]:
        """The other daemons' latest checkpoints this daemon has not cosigned yet."""
        return await self._ask(lambda conn: uncosigned(conn, self.name))

    async def store_cosignature(
        self, daemon: str, size: int, line: str, cosigner: str | None = None
    ) -> None:
        """Keep a checked cosignature line: ours (`cosigner` None) of another daemon's
        checkpoint, or a federated member's (its key name) of ours."""
        await self._ask(
            lambda conn: store_cosignature(conn, daemon, size, cosigner or self.name, line)
        )

    async def own_cosigned(self) -> str | None:
        """This daemon's latest checkpoint with every cosignature stored for it."""
        latest = self._latest
        if latest is None:
            return None
        return await self._ask(
            lambda conn: with_cosignatures(conn, self.name, latest.size, latest.note)
        )

    async def latest_cosigned(self) -> tuple[str, int, str] | None:
        """(daemon, size, note with its stored cosignatures) of the largest cosigned one."""
        size = self._size
        return await self._ask(lambda conn: latest_cosigned(conn, size))

    # ---- lifecycle ----

    async def close(self) -> None:
        """Commit what is queued, checkpoint, disconnect."""
        if self._closed:
            return
        await _stopped(self._ticker)  # the final checkpoint is this one
        self._ticker = None
        if not self.readonly and self._signer is not None:
            # A job: it runs after the appends queued before now (committed or refused).
            try:
                await self._loop.run_in_executor(self._executor, self._final_checkpoint)
            except Exception as err:
                log.warning("ledger: closing without a final checkpoint: %s", err)
        self._closed = True
        await self._drop()

    def _final_checkpoint(self) -> None:
        latest, size = self._latest, self._frontier.size
        healthy = self._halted is None and self._broken is None and self._failed is None
        if healthy and size and (latest is None or latest.size != size):
            self._latest = self._checkpoint()

    async def abandon(self) -> None:
        self._closed = True
        await self._drop()

    async def _drop(self) -> None:
        self._closed = True
        for task in (self._ticker, self._prober, self._follower):
            await _stopped(task)
        if self._pool is not None:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self._pool.close)
        loop = asyncio.get_running_loop()
        with contextlib.suppress(Exception):
            await loop.run_in_executor(self._executor, self._disconnect)
        await loop.run_in_executor(None, self._executor.shutdown)
        self._release()

    async def __aenter__(self) -> SharedLedger:
        return self


def _leaf_blocks(conn: Any, start: int, stop: int) -> list[list[bytes]]:
    """The leaf hashes in [start, stop), in blocks (a record made before `tally_nodes`)."""
    found = conn.execute(
        "SELECT leaf FROM tally_entries WHERE seq >= %s AND seq < %s ORDER BY seq", (start, stop)
    ).fetchall()
    if len(found) != stop - start:
        raise LedgerFailed(f"the shared record lacks entries between {start} and {stop}")
    leaves = [bytes(leaf) for (leaf,) in found]
    return [leaves[i : i + BATCH_ROWS] for i in range(0, len(leaves), BATCH_ROWS)]


async def _stopped(task: asyncio.Task[None] | None) -> None:
    """Cancel a background task and wait for it, boundedly."""
    if task is None or task.done():
        return
    task.cancel()
    await asyncio.wait({task}, timeout=2.0)
    if not task.done():
        log.warning("ledger: %s did not stop when cancelled; left behind", task.get_name())


def _durable(conn: Any) -> None:
    """Every session's commits are durable before they return (checkpoints go through these)."""
    conn.execute("SET synchronous_commit = on")


def _said(err: BaseException, dsn: str) -> str:
    """A driver error as one line, without the DSN's password (libpq echoes a URI or a token
    it cannot parse, password and all)."""
    text = scrub(str(err), dsn).strip().splitlines()
    return (text[0] if text else type(err).__name__)[:300]


if TYPE_CHECKING:  # both storages provide the whole interface (mypy checks it here)
    from daemon.ledger.storage import Storage

    _FILE: type[Storage] = Ledger
    _POSTGRES: type[Storage] = SharedLedger
