"""A ledger whose record lives on PostgreSQL, shared by several daemons (`--ledger postgresql://…`).

Why a subclass of `Ledger`: the engine, the gateway, the tools and the CLI are written against
`Ledger`'s public methods; this class overrides every one that touches storage (appends,
redaction, reads, proofs, verify, checkpoints, open and close) and keeps the ones that do not
(the owner's key: `vkey`, `seal`, `check_mac`, `check_signature`; `size`; `stats`). None of
the file ledger's parts (journal, pack, index, tree files) is ever opened. One piece (past 500
lines) for the same reason: it is one class, whose appends, reads and proofs share the
in-memory tree and the head this daemon knows, grown under one lock (`_grow`); the tables and
what reads them without a daemon (verify, export) live in `postgres`.

The record is the file ledger's, byte for byte: the same canonical lines (built by the same
`line_template`), RFC 9162 leaf hashes, bodies hashed the same way, C2SP checkpoint notes.
What differs is where it is kept (`daemon.ledger.postgres` has the tables) and:
- Several daemons append. Each group-commits its own appends: the appends queued while a
  commit runs form the next batch, committed as one. Seq and `prev` come from the head row
  under its lock, so two daemons never fork the chain: where the daemon knows the head (it
  wrote last, or caught up since), the batch is one statement that moves the head only if it
  is still there, and writes nothing otherwise (`WRITE`); else a transaction locks the head
  row (`SELECT … FOR UPDATE`), reads the size and last leaf hash there and writes on them.
  Every commit is durable before it returns (`synchronous_commit = on`); only then are the
  appends acknowledged. Each row names the daemon that wrote it (its checkpoint key's name),
  and a daemon's first write is a `ledger.join` entry witnessing its name and key.
- The Merkle tree is held in memory (`postgres.Levels`), loaded at open from the leaf hashes
  and grown by each commit with the entries other daemons appended since (read under the same
  lock); a follower task catches up every `FOLLOW_S` while idle. Reads see `size`: the
  entries this daemon knows are committed.
- The database unreachable (a restart, the network): the batch fails with 503 (nothing of it
  was acknowledged), health says `degraded` (reason `database_unreachable`), and a probe
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
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from daemon import layout
from daemon.errors import InvalidInput, NotFound, Unavailable
from daemon.ledger.audit import VerifyReport
from daemon.ledger.canonical import NotCanonical, canonicalize, check_text
from daemon.ledger.checkpoint import Checkpoint, SignerOnDemand, parse_note
from daemon.ledger.entry import NO_BODY, VERSION, Body, Entry, line_template
from daemon.ledger.errors import LedgerCorrupt, LedgerFailed, LedgerUnwritable
from daemon.ledger.journal import MAX_BATCH
from daemon.ledger.log import Ledger
from daemon.ledger.merkle import (
    EMPTY_ROOT,
    consistency_path,
    inclusion_path,
    root_from_inclusion,
    verify_consistency,
)
from daemon.ledger.outage import PROBE_MAX, Outage
from daemon.ledger.postgres import (
    Levels,
    checkpoints,
    connect,
    daemons,
    ensure_schema,
    export_record,
    joined_keys,
    latest_cosigned,
    latest_note,
    scrub,
    shown_dsn,
    store_cosignature,
    uncosigned,
    verify_record,
    with_cosignatures,
)
from daemon.ledger.reader import ConsistencyProof, InclusionProof
from daemon.ledger.writer import MAX_BATCH_BYTES, _Pending, _Stats
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
)
SELECT count(*) FROM moved
"""
"""A batch's bodies, entries and the new head, as one statement, written only if the head is
still where the batch was built on: the UPDATE takes the head row's lock and, if another daemon
moved the head meanwhile, re-checks its condition on the committed row and matches nothing, so
nothing is written (one chain, whatever the timing)."""

FOLLOW_S = 0.5
"""While idle, how often a daemon reads the head for entries other daemons appended."""
UNREACHABLE = "database_unreachable"
READ_TIMEOUT = 5.0


@dataclass(slots=True)
class _Built:
    entries: list[Entry]
    leaves: list[bytes]
    redactions: list[tuple[int, bytes]]
    params: dict[str, Any]
    last: str
    ts: int


class SharedLedger(Ledger):
    """Open with `await SharedLedger.open_shared(dsn, state_dir)` (module doc)."""

    def __init__(self, dsn: str, state_dir: Path | None, readonly: bool) -> None:
        # Not `Ledger.__init__`: none of the file ledger's parts (module doc).
        self.dsn = dsn
        self.shared = True
        self.state_dir = state_dir if state_dir is not None else Path("/nonexistent/tally")
        self.dir = self.state_dir / layout.LEDGER
        self.readonly = readonly
        self._size = 0
        self._levels = Levels()
        self._last_ts = 0
        self._failed: LedgerFailed | None = None
        self._outage: Outage | None = None
        self._prober: asyncio.Task[None] | None = None
        self._ticker: asyncio.Task[None] | None = None
        self._committer: asyncio.Task[None] | None = None
        self._write_failures = 0
        self._closed = False
        self._stats = _Stats()
        self._latest: Checkpoint | None = None
        self._signer: SignerOnDemand | None = None
        self._vkey: str | None = None
        self._queue: list[_Pending] = []
        self._wake = asyncio.Event()
        self._grow = asyncio.Lock()  # the tree grows under it (a commit, a catch-up)
        self._conn: Any = None  # the writer's connection
        self._pool: Any = None  # readers'
        self._lock_fd = -1
        self._head_hash: str | None = None  # the head's last hash, where this daemon knows it
        self.name = ""
        """This daemon's name in the record: its checkpoint key's name."""

    @classmethod
    async def open_shared(
        cls,
        dsn: str,
        state_dir: Path | None,
        *,
        readonly: bool = False,
        checkpoint_interval: float | None = 60.0,
    ) -> SharedLedger:
        """Connect, create the tables if missing, load the tree; the owner also loads its key
        (from `state_dir/ledger`) and joins the record. Raises `Unavailable` (naming the
        database, never its password) when it cannot be reached."""
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
        from psycopg_pool import AsyncConnectionPool

        try:
            self._conn = await connect(self.dsn)
            await ensure_schema(self._conn, self.readonly)  # a reader never runs DDL
        except psycopg.Error as err:
            raise Unavailable(
                f"cannot open the shared record at {shown_dsn(self.dsn)}: {_said(err, self.dsn)}"
            ) from err
        except LookupError as err:
            raise Unavailable(f"{shown_dsn(self.dsn)}: {scrub(str(err), self.dsn)}") from err
        self._pool = AsyncConnectionPool(
            self.dsn,
            min_size=1,
            max_size=4,
            open=False,
            timeout=READ_TIMEOUT,
            kwargs={"autocommit": True},
            configure=_durable,
        )
        await self._pool.open(wait=True, timeout=READ_TIMEOUT)
        await self._follow_head(self._conn)
        if self.readonly:
            found = latest_note(await checkpoints(self._conn))
            if found is not None:
                self._latest = parse_note(found[1])
                self._vkey = (await daemons(self._conn)).get(found[0])
            return
        assert self.state_dir is not None
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        # One daemon per state dir (its key names it in the record), as for a file ledger.
        await asyncio.to_thread(self._take_lock)
        self._signer = await asyncio.to_thread(SignerOnDemand, self.dir)
        signer = await asyncio.to_thread(self._signer.get)
        self.name = signer.name
        cur = await self._conn.execute(
            "SELECT size, note FROM tally_checkpoints WHERE daemon = %s ORDER BY size DESC LIMIT 1",
            (self.name,),
        )
        row = await cur.fetchone()
        if row is not None:
            self._latest = parse_note(row[1])
        self._committer = asyncio.create_task(self._commit_loop(), name="shared-ledger-writer")
        await self._join(signer.vkey)
        if checkpoint_interval:
            self._ticker = asyncio.create_task(
                self._tick(checkpoint_interval), name="ledger-checkpoints"
            )

    async def _join(self, vkey: str) -> None:
        """Register this daemon's key, and witness it with a `ledger.join` entry (once)."""
        cur = await self._conn.execute(
            "INSERT INTO tally_daemons (name, vkey) VALUES (%s, %s) ON CONFLICT (name) DO NOTHING"
            " RETURNING name",
            (self.name, vkey),
        )
        if await cur.fetchone() is None:
            return
        joined = LedgerJoin(daemon=self.name, vkey=vkey)
        entry = await self.append(actor="ledger", kind=joined.KIND, body=joined.written())
        await self._conn.execute(
            "UPDATE tally_daemons SET joined_seq = %s WHERE name = %s", (entry.seq, self.name)
        )

    # ---- appends ----

    def _enqueue(
        self,
        actor: str,
        kind: str,
        run: str | None,
        parent: int | None,
        data: bytes | None,
        redacts: bytes | None,
        on_commit: Callable[[Entry], None] | None = None,
    ) -> asyncio.Future[Entry]:
        future: asyncio.Future[Entry] = self._loop.create_future()
        if data is None:
            digest = body_hex = None
        else:
            digest = hashlib.sha256(data).digest()
            body_hex = digest.hex()
        head, tail = line_template(actor, kind, run, parent, body_hex)
        self._queue.append(
            _Pending(
                actor,
                kind,
                run,
                parent,
                data,
                digest,
                body_hex,
                head,
                tail,
                future,
                redacts,
                on_commit,
            )
        )
        self._wake.set()
        return future

    async def _commit_loop(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), FOLLOW_S)
            self._wake.clear()
            if not self._queue:
                if self._outage is None:
                    with contextlib.suppress(Exception):  # a failed follow is retried
                        await self._follow()
                continue
            while self._queue:
                batch: list[_Pending] = []
                size = 0
                while self._queue and len(batch) < MAX_BATCH and size < MAX_BATCH_BYTES:
                    pending = self._queue.pop(0)
                    batch.append(pending)
                    size += len(pending.body or b"")
                await self._commit_batch_shared(batch)

    async def _commit_batch_shared(self, batch: list[_Pending]) -> None:
        import psycopg

        if self._failed is not None or self._outage is not None:
            error: Exception = self._failed or self._outage.error()  # type: ignore[union-attr]
            for pending in batch:
                if not pending.future.done():
                    pending.future.set_exception(error)
            return
        t0 = time.perf_counter()
        try:
            entries = await self._transact(batch)
        except LedgerFailed as err:
            self._failed = err
            for pending in batch:
                if not pending.future.done():
                    pending.future.set_exception(err)
            return
        except (psycopg.Error, OSError) as err:
            self._write_failures += 1
            outage = Outage(UNREACHABLE, self._unreachable(err), time.monotonic(), None)
            self._begin_outage(outage)
            for pending in batch:
                if not pending.future.done():
                    pending.future.set_exception(outage.error())
            return
        self._stats.observe(time.perf_counter() - t0)
        self._stats.appends += len(batch)
        self._stats.batches += 1
        for pending, entry in zip(batch, entries, strict=True):
            if pending.on_commit is not None:
                try:
                    pending.on_commit(entry)
                except Exception:
                    log.exception("ledger: an on_commit hook failed for seq %d", entry.seq)
            if not pending.future.done():
                pending.future.set_result(entry)

    async def _transact(self, batch: list[_Pending]) -> list[Entry]:
        """Commit a batch. Where this daemon knows the head (it wrote last, or has caught up
        since), the batch is one autocommit statement conditional on that head (`WRITE`): one
        round trip. Otherwise, or if another daemon moved the head first, or for a redaction,
        one transaction locks the head row (`SELECT … FOR UPDATE`), catches the tree up with
        the entries it holds past this daemon's, and writes on that head."""
        conn = await self._writer()
        async with self._grow:
            ts = max(time.time_ns() // 1000, self._last_ts)
            head = self._head_hash
            if head is not None and all(p.redacts is None for p in batch):
                built = self._build(batch, self._levels.size, head, ts)
                self._head_hash = None  # unknown until the answer: a lost one leaves it so
                cur = await conn.execute(WRITE, built.params)
                if (await cur.fetchone())[0] == 1:
                    return self._committed([], built)
            async with conn.transaction():
                cur = await conn.execute(
                    "SELECT size, last_hash, last_ts FROM tally_head FOR UPDATE"
                )
                size, prev, last_ts = await cur.fetchone()
                known = await self._fetch_leaves(conn, size)
                built = self._build(batch, size, prev, max(ts, last_ts))
                cur = await conn.execute(WRITE, built.params)
                if (await cur.fetchone())[0] != 1:
                    raise LedgerFailed("the record's head moved under its lock")
                for at, digest in built.redactions:  # after: a statement changes a row once
                    await conn.execute(
                        "UPDATE tally_bodies SET data = NULL, redacted_at = %s WHERE digest = %s",
                        (at, digest),
                    )
            return self._committed(known, built)

    def _committed(self, known: list[bytes], built: _Built) -> list[Entry]:
        """Committed (durable: synchronous_commit = on): the tree grows, then the acks."""
        self._extend(known)
        self._extend(built.leaves)
        self._last_ts = built.ts
        self._head_hash = built.last
        return built.entries

    def _build(self, batch: list[_Pending], seq: int, prev: str, ts: int) -> _Built:
        """The batch's lines on the head (seq, prev), their leaf hashes, and the statement's
        parameters."""
        was_size, was_last = seq, prev
        leaves: list[bytes] = []
        entries: list[Entry] = []
        rows: list[tuple[Any, ...]] = []
        bodies: dict[bytes, bytes] = {}
        redactions: list[tuple[int, bytes]] = []
        for p in batch:
            line = f'{p.head}{prev}{p.tail}{seq},"ts":{ts},"v":{VERSION}}}'.encode()
            leaf = hashlib.sha256(b"\x00" + line).digest()
            leaves.append(leaf)
            rows.append((seq, line, leaf, p.kind, p.run, p.actor, p.digest))
            if p.digest is not None and p.body is not None:
                bodies.setdefault(p.digest, p.body)
            if p.redacts is not None:
                redactions.append((seq, p.redacts))
            entries.append(
                Entry.model_construct(
                    v=VERSION,
                    seq=seq,
                    ts=ts,
                    actor=p.actor,
                    kind=p.kind,
                    run=p.run,
                    parent=p.parent,
                    body=p.body_hex,
                    prev=prev,
                    hash=leaf.hex(),
                )
            )
            prev = leaf.hex()
            seq += 1
        columns = [list(c) for c in zip(*rows, strict=True)]
        params = {
            "size": seq,
            "last": prev,
            "ts": ts,
            "was_size": was_size,
            "was_last": was_last,
            "digests": list(bodies),
            "lengths": [len(b) for b in bodies.values()],
            "datas": list(bodies.values()),
            "daemon": self.name,
            **dict(
                zip(
                    ("seqs", "lines", "leaves", "kinds", "runs", "actors", "bodies"),
                    columns,
                    strict=True,
                )
            ),
        }
        return _Built(entries, leaves, redactions, params, prev, ts)

    async def _fetch_leaves(self, conn: Any, size: int) -> list[bytes]:
        """The leaf hashes the record holds past this daemon's tree (others' appends)."""
        have = self._levels.size
        if size < have:
            raise LedgerFailed(
                f"the shared record shrank: it holds {size} entries, this daemon saw {have} "
                "(a database restored from an older backup?); stop every daemon and check it "
                "with `tally ledger verify --ledger …`"
            )
        if size == have:
            return []
        cur = await conn.execute(
            "SELECT seq, leaf FROM tally_entries WHERE seq >= %s AND seq < %s ORDER BY seq",
            (have, size),
        )
        found = await cur.fetchall()
        if len(found) != size - have or (found and found[0][0] != have):
            raise LedgerFailed(f"the shared record lacks entries between {have} and {size}")
        return [bytes(leaf) for _, leaf in found]

    def _extend(self, leaves: list[bytes]) -> None:
        if leaves:
            self._levels.extend(leaves)
            self._size = self._levels.size

    async def _follow_head(self, conn: Any) -> None:
        async with self._grow:
            cur = await conn.execute("SELECT size, last_hash, last_ts FROM tally_head")
            size, last_hash, last_ts = await cur.fetchone()
            self._extend(await self._fetch_leaves(conn, size))
            self._last_ts = max(self._last_ts, last_ts)
            self._head_hash = last_hash

    async def _follow(self) -> None:
        await self._follow_head(await self._writer())

    async def refresh(self) -> int:
        """Catch up with the entries other daemons appended; the new size."""
        async with self._pool.connection() as conn:
            await self._follow_head(conn)
        return self._size

    async def _writer(self) -> Any:
        if self._conn is None or self._conn.closed:
            self._conn = await connect(self.dsn)
        return self._conn

    # ---- outages ----

    async def _probe_loop(self) -> None:
        import psycopg

        while (outage := self._outage) is not None:
            await asyncio.sleep(outage.delay)
            try:
                if self._conn is not None:
                    with contextlib.suppress(Exception):
                        await self._conn.close()
                self._conn = None
                await self._follow_head(await self._writer())
            except (psycopg.Error, OSError) as err:
                self._write_failures += 1
                outage.reason, outage.detail = UNREACHABLE, self._unreachable(err)
                outage.failures += 1
                outage.delay = min(outage.delay * 2, PROBE_MAX)
                log.warning("ledger: the database is still unreachable (%s)", outage.detail)
                continue
            log.warning(
                "ledger: the database answers again after %.1f s; appends resume",
                time.monotonic() - outage.since,
            )
            self._outage = None

    def _unreachable(self, err: BaseException) -> str:
        return f"the shared record at {shown_dsn(self.dsn)} is unreachable: {_said(err, self.dsn)}"

    def _begin_outage(self, outage: Outage) -> None:
        if self._outage is not None:
            return
        self._outage = outage
        log.error(
            "ledger: %s; appends fail with 503 until it answers again",
            outage.detail,
        )
        if not self._closed:
            self._prober = asyncio.create_task(self._probe_loop(), name="ledger-probe")

    # ---- redaction ----

    async def redact(self, body_hash: str, *, actor: str, reason: str) -> Entry:
        """The `redaction` entry and the body's removal, in one transaction."""
        try:
            digest = bytes.fromhex(body_hash)
        except ValueError as err:
            raise InvalidInput(f"not a body hash: {body_hash!r}") from err
        self._check_writable()
        if not isinstance(actor, str) or not actor:
            raise InvalidInput("actor must be a non-empty string")
        async with self._reading() as conn:
            cur = await conn.execute("SELECT 1 FROM tally_bodies WHERE digest = %s", (digest,))
            if await cur.fetchone() is None:
                raise NotFound(f"no body {body_hash}")
        try:
            check_text(actor)
            data = canonicalize({"redacted": body_hash, "reason": reason})
        except NotCanonical as err:
            raise InvalidInput(f"not storable in the ledger: {err}") from err
        return await self._enqueue(actor, "redaction", None, None, data, digest)

    # ---- reads ----

    @contextlib.asynccontextmanager
    async def _reading(self) -> Any:
        """A reader's connection; an unreachable database is a 503 naming it."""
        import psycopg
        from psycopg_pool import PoolTimeout

        try:
            async with self._pool.connection() as conn:
                yield conn
        except (psycopg.OperationalError, PoolTimeout) as err:
            raise LedgerUnwritable(
                UNREACHABLE, _said(err, self.dsn), 1.0, what="the shared record cannot be read now"
            ) from err

    async def get(self, seq: int) -> Entry:
        if not 0 <= seq < self._size:
            raise NotFound(f"no ledger entry {seq} (size {self._size})")
        async with self._reading() as conn:
            cur = await conn.execute("SELECT line FROM tally_entries WHERE seq = %s", (seq,))
            row = await cur.fetchone()
        if row is None:
            raise LedgerCorrupt(seq, f"entry {seq} is missing from the shared record")
        return Entry.from_line(bytes(row[0]))

    def read_body(self, body_hash: str | None) -> Body:
        raise LedgerFailed("a shared record's bodies are read with `body` or `read_bodies`")

    async def body(self, body_hash: str | None) -> Body:
        return (await self.read_bodies([body_hash]))[0]

    async def read_bodies(self, hashes: Sequence[str | None]) -> list[Body]:
        wanted: dict[bytes, str] = {}
        for h in hashes:
            if h is not None:
                with contextlib.suppress(ValueError):
                    wanted[bytes.fromhex(h)] = h
        if not wanted:
            return [NO_BODY if h is None else Body("missing") for h in hashes]
        async with self._reading() as conn:
            cur = await conn.execute(
                "SELECT digest, data, redacted_at FROM tally_bodies WHERE digest = ANY(%s)",
                (list(wanted),),
            )
            found = {bytes(d): (data, at) for d, data, at in await cur.fetchall()}
        out: list[Body] = []
        for h in hashes:
            if h is None:
                out.append(NO_BODY)
                continue
            try:
                row = found.get(bytes.fromhex(h))
            except ValueError:
                row = None
            if row is None:
                out.append(Body("missing"))
            elif row[0] is None:
                out.append(Body("redacted" if row[1] is not None else "missing"))
            elif hashlib.sha256(bytes(row[0])).hexdigest() != h:
                out.append(Body("tampered"))
            else:
                out.append(Body("present", json.loads(bytes(row[0]))))
        return out

    async def entries(
        self,
        start: int = 0,
        limit: int = 100,
        kind: str | None = None,
        run: str | None = None,
        actor: str | None = None,
        in_run: bool = False,
    ) -> list[Entry]:
        """As `Ledger.entries`; `in_run` with no run named reads this daemon's entries only
        (replay: runs stay per daemon, see the module doc)."""
        size = self._size
        if limit <= 0 or start >= size:
            return []
        where = ["seq >= %s", "seq < %s"]
        params: list[Any] = [max(start, 0), size]
        for column, value in (("kind", kind), ("run", run), ("actor", actor)):
            if value is not None:
                where.append(f"{column} = %s")
                params.append(value)
        if in_run:
            where.append("run IS NOT NULL")
            if run is None and not self.readonly:
                where.append("daemon = %s")
                params.append(self.name)
        params.append(limit)
        async with self._reading() as conn:
            cur = await conn.execute(
                f"SELECT line FROM tally_entries WHERE {' AND '.join(where)} ORDER BY seq LIMIT %s",
                params,
            )
            found = await cur.fetchall()
        return [Entry.from_line(bytes(line)) for (line,) in found]

    async def causal_chain(self, seq: int) -> list[Entry]:
        chain = [await self.get(seq)]
        while chain[-1].parent is not None:
            chain.append(await self.get(chain[-1].parent))
        chain.reverse()
        return chain

    async def writers(self, seqs: Sequence[int]) -> dict[int, str]:
        """Which daemon wrote each of these entries."""
        async with self._reading() as conn:
            cur = await conn.execute(
                "SELECT seq, daemon FROM tally_entries WHERE seq = ANY(%s)", (list(seqs),)
            )
            return {int(s): d for s, d in await cur.fetchall()}

    async def foreign_runs(self, limit: int) -> list[tuple[str, str]]:
        """(run id, daemon) of the newest runs other daemons started, newest first."""
        async with self._reading() as conn:
            cur = await conn.execute(
                "SELECT run, daemon FROM tally_entries WHERE kind = 'run.request' "
                "AND run IS NOT NULL AND daemon <> %s AND seq < %s ORDER BY seq DESC LIMIT %s",
                (self.name, self._size, limit),
            )
            return [(r, d) for r, d in await cur.fetchall()]

    async def verify(self, deep: bool = False) -> VerifyReport:
        async with self._reading() as conn:
            return await verify_record(conn, deep)

    async def export(self, target: Path) -> dict[str, Any]:
        async with self._reading() as conn:
            return await export_record(conn, target)

    # ---- cosignatures (`daemon.cosigning.Cosigner.cosign_shared`) ----

    async def joined_keys(self) -> dict[str, str]:
        """Every daemon's key, as its `ledger.join` entry in the record witnesses it."""
        async with self._reading() as conn:
            return await joined_keys(conn)

    async def uncosigned(self) -> list[tuple[str, int, str]]:
        """The other daemons' latest checkpoints this daemon has not cosigned yet."""
        async with self._reading() as conn:
            return await uncosigned(conn, self.name)

    async def store_cosignature(
        self, daemon: str, size: int, line: str, cosigner: str | None = None
    ) -> None:
        """Keep a checked cosignature line: ours (`cosigner` None) of another daemon's
        checkpoint, or a federated member's (its key name) of ours."""
        async with self._reading() as conn:
            await store_cosignature(conn, daemon, size, cosigner or self.name, line)

    async def own_cosigned(self) -> str | None:
        """This daemon's latest checkpoint with every cosignature stored for it."""
        latest = self._latest
        if latest is None:
            return None
        async with self._reading() as conn:
            return await with_cosignatures(conn, self.name, latest.size, latest.note)

    async def latest_cosigned(self) -> tuple[str, int, str] | None:
        """(daemon, size, note with its stored cosignatures) of the largest cosigned one."""
        async with self._reading() as conn:
            return await latest_cosigned(conn, self._size)

    @property
    def record_note(self) -> str | None:
        return None

    # ---- proofs ----

    def root(self, size: int | None = None) -> str:
        size = self._size if size is None else size
        if not 0 <= size <= self._size:
            raise NotFound(f"tree size {size} is beyond the ledger's size {self._size}")
        return self._levels.root(size).hex()

    def leaf_hash(self, seq: int) -> str:
        return self._levels.levels[0][seq].hex()

    async def inclusion_proof(self, seq: int, size: int | None = None) -> InclusionProof:
        size = self._size if size is None else size
        if not 0 <= seq < size <= self._size:
            raise NotFound(f"no inclusion proof for seq {seq} in a tree of size {size}")
        entry = await self.get(seq)  # the leaf re-hashed from the record's line
        levels = self._levels
        path = inclusion_path(seq, size, levels.subtree)
        root = levels.root(size)
        if root_from_inclusion(seq, size, bytes.fromhex(entry.hash), path) != root:
            raise LedgerCorrupt(seq, f"entry {seq}'s line is not the leaf the tree holds")
        return InclusionProof(
            leaf_index=seq, tree_size=size, root=root.hex(), path=[p.hex() for p in path]
        )

    async def consistency_proof(self, old: int, new: int | None = None) -> ConsistencyProof:
        new = self._size if new is None else new
        if not 0 <= old <= new <= self._size:
            raise NotFound(f"no consistency proof from size {old} to {new}")
        levels = self._levels
        path = consistency_path(old, new, levels.subtree)
        old_root = levels.root(old) if old else EMPTY_ROOT
        new_root = levels.root(new)
        if not verify_consistency(old, new, old_root, new_root, path):
            raise LedgerCorrupt(max(old - 1, 0), "a consistency proof did not verify")
        return ConsistencyProof(
            old_size=old,
            new_size=new,
            old_root=old_root.hex(),
            new_root=new_root.hex(),
            path=[p.hex() for p in path],
        )

    # ---- checkpoints ----

    async def checkpoint(self) -> Checkpoint:
        """Sign the tree this daemon knows (every entry in it committed) and store the note."""
        import psycopg

        if self.readonly or self._signer is None:
            raise LedgerFailed("checkpoints are written by the ledger's owner only")
        if self._failed is not None:
            raise self._failed
        if self._outage is not None:
            raise self._outage.error(what="no checkpoint was written")
        signer = await asyncio.to_thread(self._signer.get)
        size = self._size
        checkpoint = signer.sign(
            size, self._levels.root(size), max(time.time_ns() // 1000, self._last_ts)
        )
        try:
            async with self._reading() as conn:
                await conn.execute(
                    "INSERT INTO tally_checkpoints (daemon, size, root, note) "
                    "VALUES (%s, %s, %s, %s) ON CONFLICT (daemon, size) DO UPDATE "
                    "SET note = EXCLUDED.note, root = EXCLUDED.root, signed_at = now()",
                    (self.name, size, bytes.fromhex(checkpoint.root), checkpoint.note),
                )
        except psycopg.Error as err:
            raise LedgerUnwritable(
                UNREACHABLE, _said(err, self.dsn), 1.0, what="no checkpoint was written"
            ) from err
        self._latest = checkpoint
        return checkpoint

    async def _tick(self, interval: float) -> None:
        """`Ledger._tick`, ending once the ledger closes (see `_stopped`)."""
        while not self._closed:
            await asyncio.sleep(interval)
            latest = self._latest
            healthy = self._failed is None and self._outage is None and not self._closed
            if healthy and (latest is None or latest.size != self._size):
                try:
                    await self.checkpoint()
                except LedgerUnwritable as err:
                    log.warning("ledger: periodic checkpoint skipped: %s", err.message)
                except Exception:
                    log.exception("ledger: periodic checkpoint failed")

    # ---- lifecycle ----

    async def close(self) -> None:
        """Commit what is queued, checkpoint, disconnect."""
        if self._closed:
            return
        await _stopped(self._ticker)  # the final checkpoint is this one
        self._ticker = None
        if not self.readonly and self._committer is not None:
            for _ in range(200):  # appends queued before now are committed (or refused)
                if not self._queue:
                    break
                await asyncio.sleep(0.01)
            latest = self._latest
            healthy = self._failed is None and self._outage is None and self._size
            if healthy and (latest is None or latest.size != self._size):
                try:
                    await self.checkpoint()
                except Exception as err:
                    log.warning("ledger: closing without a final checkpoint: %s", err)
        self._closed = True
        await self._drop()

    async def abandon(self) -> None:
        self._closed = True
        await self._drop()

    async def _drop(self) -> None:
        for task in (self._ticker, self._prober, self._committer):
            await _stopped(task)
        for pending in self._queue:
            if not pending.future.done():
                pending.future.set_exception(LedgerFailed("the ledger is closed"))
        self._queue.clear()
        if self._conn is not None:
            with contextlib.suppress(Exception):
                await self._conn.close()
        if self._pool is not None:
            with contextlib.suppress(Exception):
                await self._pool.close()
        self._release()

    def _release(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    async def __aenter__(self) -> SharedLedger:
        return self


async def _stopped(task: asyncio.Task[None] | None) -> None:
    """Cancel a background task and wait for it, boundedly: a cancellation that lands inside
    the driver's own `wait_for` can be swallowed on Python 3.11, leaving the task running on."""
    if task is None or task.done():
        return
    task.cancel()
    await asyncio.wait({task}, timeout=2.0)
    if not task.done():
        log.warning("ledger: %s did not stop when cancelled; left behind", task.get_name())


async def _durable(conn: Any) -> None:
    """Every session's commits are durable before they return (checkpoints go through these)."""
    await conn.execute("SET synchronous_commit = on")


def _said(err: BaseException, dsn: str) -> str:
    """A driver error as one line, without the DSN's password (libpq echoes a URI or a token
    it cannot parse, password and all)."""
    text = scrub(str(err), dsn).strip().splitlines()
    return (text[0] if text else type(err).__name__)[:300]
