"""The shared record's tables on PostgreSQL, and what reads them without a daemon: the
verify walk and the export to the file layout.

Tables (created on first use, in one transaction under an advisory lock, so daemons starting
together do not race):
- `tally_head`: one row, the record's size, last leaf hash and last `ts`. Every append
  transaction takes it `FOR UPDATE`, so seq and `prev` are assigned by one writer at a time
  and the chain cannot fork.
- `tally_entries`: one row per entry: `line` is the canonical entry line, byte for byte what a
  file ledger's `entries.jsonl` would hold, `leaf` its RFC 9162 leaf hash, `daemon` the name
  of the daemon that wrote it (its checkpoint key's name: outside the line, so the canonical
  bytes are the file ledger's), and `kind`, `run`, `actor`, `body` for the filters.
- `tally_bodies`: content-addressed bodies (SHA-256 of the canonical JSON); redaction sets
  `data` to NULL and `redacted_at` to the witnessing entry's seq, in the same transaction as
  that entry. `length` stays, as the file pack keeps a redacted record's length.
- `tally_daemons`: each daemon's name and verifier key (C2SP vkey), and the seq of its
  `ledger.join` entry (the record's own witness of the key).
- `tally_checkpoints`: every signed checkpoint note, by daemon and size. Cosignatures (C2SP
  tlog-cosignature) attach to these rows: `tally_cosignatures` is their place.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import re
import urllib.parse
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from daemon import layout
from daemon.errors import InvalidInput
from daemon.ledger.audit import TAMPERED_BODIES, VerifyReport
from daemon.ledger.checkpoint import CheckpointError, parse_note, verify_note
from daemon.ledger.entry import GENESIS_PREV, Entry
from daemon.ledger.merkle import EMPTY_ROOT, Frontier, node_hash, split_point
from daemon.ledger.store import PACK_HEADER, REDACTED

SCHEMA_LOCK = 0x7A11_7EC0  # pg_advisory_xact_lock key while the tables are created

SCHEMA = f"""
CREATE TABLE IF NOT EXISTS tally_head (
    one boolean PRIMARY KEY DEFAULT true CHECK (one),
    size bigint NOT NULL,
    last_hash text NOT NULL,
    last_ts bigint NOT NULL
);
INSERT INTO tally_head (one, size, last_hash, last_ts) VALUES (true, 0, '{GENESIS_PREV}', 0)
    ON CONFLICT DO NOTHING;
CREATE TABLE IF NOT EXISTS tally_daemons (
    name text PRIMARY KEY,
    vkey text NOT NULL,
    joined_seq bigint,
    joined_at timestamptz NOT NULL DEFAULT now()
);
CREATE TABLE IF NOT EXISTS tally_entries (
    seq bigint PRIMARY KEY,
    line bytea NOT NULL,
    leaf bytea NOT NULL,
    kind text NOT NULL,
    run text,
    actor text NOT NULL,
    body bytea,
    daemon text NOT NULL REFERENCES tally_daemons (name)
);
CREATE INDEX IF NOT EXISTS tally_entries_run ON tally_entries (run, seq) WHERE run IS NOT NULL;
CREATE INDEX IF NOT EXISTS tally_entries_kind ON tally_entries (kind, seq);
CREATE INDEX IF NOT EXISTS tally_entries_daemon ON tally_entries (daemon, seq);
CREATE TABLE IF NOT EXISTS tally_bodies (
    digest bytea PRIMARY KEY,
    length integer NOT NULL,
    data bytea,
    redacted_at bigint
);
CREATE TABLE IF NOT EXISTS tally_checkpoints (
    daemon text NOT NULL REFERENCES tally_daemons (name),
    size bigint NOT NULL,
    root bytea NOT NULL,
    note text NOT NULL,
    signed_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (daemon, size)
);
CREATE TABLE IF NOT EXISTS tally_cosignatures (
    daemon text NOT NULL,
    size bigint NOT NULL,
    cosigner text NOT NULL,
    signature text NOT NULL,
    PRIMARY KEY (daemon, size, cosigner),
    FOREIGN KEY (daemon, size) REFERENCES tally_checkpoints (daemon, size)
);
"""

JOIN_KIND = "ledger.join"
"""The entry a daemon appends when it first writes to a shared record: its name and key."""

BATCH_ROWS = 4096


def is_dsn(text: str | None) -> bool:
    """Whether `--ledger` names a PostgreSQL record (else it is not one we know)."""
    return bool(text) and str(text).startswith(("postgresql://", "postgres://"))


def check_dsn(text: str) -> str:
    if not is_dsn(text):
        scheme = text.partition("://")[0] if "://" in text else "a text"
        raise InvalidInput(
            f"--ledger names {scheme[:20]!r}, not a PostgreSQL URL: use postgresql://… "
            "(the file ledger in the state dir is the default)"
        )
    return text


_SECRETS = (
    re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://[^/@?#]*?:([^@/?#]*)@"),  # user:PASSWORD@
    re.compile(r"[?&]password=([^&#]*)"),  # ?password=
    re.compile(r"(?:^|\s)password\s*=\s*('(?:[^'\\]|\\.)*'|\S+)"),  # keyword form
)


def scrub(text: str, dsn: str) -> str:
    """`text` (a driver's message) without the DSN's password in any form it may echo: libpq
    quotes the token or the whole URI it could not parse (a bad %-escape, an unclosed `[`)."""
    found = {dsn}
    for pattern in _SECRETS:
        for match in pattern.finditer(dsn):
            raw = match.group(1).strip("'")
            found |= {raw, urllib.parse.unquote(raw)}
    with contextlib.suppress(Exception):
        from psycopg.conninfo import conninfo_to_dict

        found.add(str(conninfo_to_dict(dsn).get("password") or ""))
    for secret in sorted((s for s in found if s), key=len, reverse=True):
        text = text.replace(secret, "…")
    return text


def shown_dsn(dsn: str) -> str:
    """The URL without its password (for messages and `health`)."""
    try:
        from psycopg.conninfo import conninfo_to_dict

        parts = conninfo_to_dict(dsn)
    except Exception:
        return "postgresql://…"
    host = parts.get("host") or "localhost"
    return f"postgresql://{parts.get('user') or ''}@{host}/{parts.get('dbname') or ''}"


async def connect(dsn: str, timeout: float = 5.0) -> Any:
    """One connection, with what a record needs on every session: commits are durable before
    they return (`synchronous_commit = on`, whatever the server's default)."""
    import psycopg

    conn = await psycopg.AsyncConnection.connect(
        dsn, connect_timeout=max(1, int(timeout)), autocommit=True
    )
    await conn.execute("SET synchronous_commit = on")
    return conn


async def ensure_schema(conn: Any, readonly: bool = False) -> None:
    """Create the tables once. When they exist, no DDL runs: `CREATE INDEX IF NOT EXISTS`
    would take a share lock on the entries and stall the other daemons' appends. A reader
    (`readonly`) never creates them: a database without them holds no record to read."""
    cur = await conn.execute("SELECT to_regclass('tally_cosignatures') IS NOT NULL")
    if (await cur.fetchone())[0]:
        return
    if readonly:
        raise LookupError(
            "no tally record in this database (its tables are missing): check the URL, or "
            "start a daemon with --ledger on it first"
        )
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock(%s)", (SCHEMA_LOCK,))
        await conn.execute(SCHEMA)


class Levels:
    """The record's Merkle tree in memory: every complete subtree hash, level by level (two
    hashes per leaf, at most): proofs in O(log n) hashes with no reads."""

    def __init__(self) -> None:
        self.levels: list[list[bytes]] = [[]]
        self.frontier = Frontier()

    @property
    def size(self) -> int:
        return len(self.levels[0])

    def extend(self, leaves: list[bytes]) -> None:
        self.levels[0].extend(leaves)
        for level, digest in self.frontier.push_many(leaves):
            while len(self.levels) <= level:
                self.levels.append([])
            self.levels[level].append(digest)

    def subtree(self, start: int, end: int) -> bytes:
        n = end - start
        if n & (n - 1) == 0 and start % n == 0:
            return self.levels[n.bit_length() - 1][start // n]
        k = split_point(n)
        return node_hash(self.subtree(start, start + k), self.subtree(start + k, end))

    def root(self, size: int | None = None) -> bytes:
        size = self.size if size is None else size
        if size == self.size:
            return self.frontier.root()
        return self.subtree(0, size) if size else EMPTY_ROOT


async def rows(conn: Any, query: str, params: tuple[Any, ...] = ()) -> AsyncIterator[Any]:
    """A large result streamed through a server-side cursor (inside a transaction)."""
    async with conn.cursor(name="tally_walk") as cur:
        cur.itersize = BATCH_ROWS
        await cur.execute(query, params)
        async for row in cur:
            yield row


async def daemons(conn: Any) -> dict[str, str]:
    cur = await conn.execute("SELECT name, vkey FROM tally_daemons ORDER BY name")
    return dict(await cur.fetchall())


async def checkpoints(conn: Any, upto: int | None = None) -> list[tuple[str, int, str]]:
    """(daemon, size, note) of every stored checkpoint (at most `upto` entries), by size."""
    cur = await conn.execute(
        "SELECT daemon, size, note FROM tally_checkpoints"
        + ("" if upto is None else " WHERE size <= %s")
        + " ORDER BY size, daemon",
        () if upto is None else (upto,),
    )
    return [(d, int(s), n) for d, s, n in await cur.fetchall()]


async def verify_record(conn: Any, deep: bool) -> VerifyReport:
    """Walk the whole record in seq order, as `tally ledger verify` walks `entries.jsonl`:
    each line canonical and the entry it claims to be, chained to the one before, its stored
    leaf hash re-computed; the root at every daemon's stored checkpoint, and the checkpoint's
    signature by that daemon's key; with `deep`, every body re-hashed (redacted vs tampered).
    Runs in one REPEATABLE READ transaction: a snapshot, whatever daemons append meanwhile."""
    async with conn.transaction():
        await conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        return await _walk(conn, deep)


async def _walk(conn: Any, deep: bool) -> VerifyReport:
    cur = await conn.execute("SELECT size FROM tally_head")
    size = int((await cur.fetchone())[0])
    keys = await daemons(conn)
    pending: dict[int, list[tuple[str, str]]] = {}
    warnings: list[str] = []
    for daemon, at, note in await checkpoints(conn, size):
        pending.setdefault(at, []).append((daemon, note))
    frontier = Frontier()
    prev = GENESIS_PREV
    redacted: list[str] = []
    tampered: list[str] = []
    why: dict[str, str] = {}
    witnessed: set[str] = set()
    seen_redacted: dict[str, int] = {}
    query = (
        "SELECT e.seq, e.line, e.leaf, e.daemon, b.data, b.digest, b.redacted_at "
        "FROM tally_entries e LEFT JOIN tally_bodies b ON b.digest = e.body ORDER BY e.seq"
        if deep
        else "SELECT seq, line, leaf, daemon, NULL, NULL, NULL FROM tally_entries ORDER BY seq"
    )
    expect = 0

    def failed(seq: int, reason: str) -> VerifyReport:
        return VerifyReport(
            ok=False, size=size, root="", first_bad_seq=seq, reason=reason, warnings=warnings
        )

    async for seq, line, leaf, daemon, data, found, redacted_at in rows(conn, query):
        line = bytes(line)
        if seq != expect:
            return failed(expect, f"entry {expect} is missing from the record (next: {seq})")
        try:
            entry = Entry.from_line(line)
        except ValueError as err:
            return failed(seq, f"entry {seq} is not a canonical entry line: {err}")
        if entry.seq != seq:
            return failed(seq, f"the line stored at seq {seq} is entry {entry.seq}")
        if entry.prev != prev:
            return failed(seq, f"entry {seq} does not chain: its prev is not entry {seq - 1}'s")
        computed = hashlib.sha256(b"\x00" + line).digest()
        if bytes(leaf) != computed:
            return failed(seq, f"the stored leaf hash of entry {seq} is not its line's")
        if daemon not in keys:
            return failed(seq, f"entry {seq} names a writer {daemon!r} with no key in the record")
        frontier.push(computed)
        prev = computed.hex()
        expect += 1
        if deep and entry.body is not None:
            if found is None:
                tampered.append(entry.body)
                why[entry.body] = f"missing (entry {seq})"
            elif data is None:
                if redacted_at is not None and entry.body not in seen_redacted:
                    seen_redacted[entry.body] = seq
                    redacted.append(entry.body)
            elif hashlib.sha256(bytes(data)).hexdigest() != entry.body:
                tampered.append(entry.body)
                why[entry.body] = f"changed (entry {seq})"
            elif entry.kind == "redaction":
                named = json.loads(bytes(data)).get("redacted")
                if isinstance(named, str):
                    witnessed.add(named)
        for daemon_name, note in pending.pop(frontier.size, ()):
            problem = _check_note(note, keys.get(daemon_name), frontier.root())
            if problem is not None:
                return failed(
                    frontier.size - 1, f"checkpoint of {daemon_name} at size {seq + 1}: {problem}"
                )
    if expect != size:
        return failed(expect, f"the record holds {expect} entries, its head says {size}")
    for digest in redacted:
        if digest not in witnessed:
            tampered.append(digest)
            why[digest] = f"removed without a witnessed redaction (entry {seen_redacted[digest]})"
    redacted = [d for d in redacted if d in witnessed]
    if tampered:
        return VerifyReport(
            ok=False,
            size=size,
            root=frontier.root().hex(),
            first_bad_seq=None,
            reason=TAMPERED_BODIES,
            redacted=redacted,
            tampered=tampered,
            tampered_why=why,
            warnings=warnings,
        )
    return VerifyReport(
        ok=True, size=size, root=frontier.root().hex(), redacted=redacted, warnings=warnings
    )


def _check_note(note: str, vkey: str | None, root: bytes) -> str | None:
    if vkey is None:
        return "its daemon has no key in the record"
    try:
        checkpoint = verify_note(note, vkey)
    except (CheckpointError, ValueError) as err:
        return f"the signature does not verify ({err})"
    if checkpoint.root != root.hex():
        return "its root is not the record's at that size"
    return None


async def export_record(conn: Any, target: Path) -> dict[str, Any]:
    """Write the record as a file ledger's layout in `target/ledger/`: `entries.jsonl` (the
    lines, byte for byte), `bodies.pack` (a redacted body zeroed and flagged, as the file
    ledger does it), `checkpoint` + `checkpoint.vkey` (the largest signed checkpoint in the
    export and its daemon's key), so `tally ledger verify --state TARGET` and any RFC 9162 or
    signed-note verifier read it as they read a daemon's state dir; `checkpoint.cosigned`, the
    largest checkpoint with the cosignatures stored for it (`--cosigner … --quorum N`). Beside
    them (ignored by those verifiers): `checkpoints/` (every daemon's notes), `daemons.json`
    (names and keys) and `writers.jsonl` (which daemon wrote which seqs, as ranges). One
    REPEATABLE READ snapshot; `target/ledger` must not exist yet (nothing is overwritten)."""
    out = target / layout.LEDGER
    if out.exists():
        raise InvalidInput(f"{out} exists: export writes into a new directory")
    out.mkdir(parents=True, mode=0o700)
    async with conn.transaction():
        await conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        cur = await conn.execute("SELECT size FROM tally_head")
        size = int((await cur.fetchone())[0])
        keys = await daemons(conn)
        notes = await checkpoints(conn, size)
        cosigned = await latest_cosigned(conn, size)
        writers: list[dict[str, Any]] = []
        packed: set[bytes] = set()
        count = 0
        # Blocking writes on the loop: the export is a CLI command, its loop serves no one else.
        with (
            open(out / layout.ENTRIES, "wb") as entries,  # noqa: ASYNC230
            open(out / layout.BODIES_PACK, "wb") as pack,  # noqa: ASYNC230
        ):
            query = (
                "SELECT e.seq, e.line, e.daemon, e.body, b.length, b.data FROM tally_entries e "
                "LEFT JOIN tally_bodies b ON b.digest = e.body WHERE e.seq < %s ORDER BY e.seq"
            )
            async for seq, line, daemon, body, length, data in rows(conn, query, (size,)):
                entries.write(bytes(line) + b"\n")
                count += 1
                if writers and writers[-1]["daemon"] == daemon and writers[-1]["to"] == seq - 1:
                    writers[-1]["to"] = seq
                else:
                    writers.append({"from": seq, "to": seq, "daemon": daemon})
                if body is None or length is None or bytes(body) in packed:
                    continue
                digest = bytes(body)
                packed.add(digest)
                if data is None:
                    pack.write(PACK_HEADER.pack(digest, length, REDACTED) + bytes(length))
                else:
                    pack.write(PACK_HEADER.pack(digest, length, 0) + bytes(data))
            entries.flush()
            os.fsync(entries.fileno())
            pack.flush()
            os.fsync(pack.fileno())
    (out / "checkpoints").mkdir()
    for daemon, at, note in notes:
        name = base64.urlsafe_b64encode(daemon.encode()).decode().rstrip("=")
        (out / "checkpoints" / f"{at:012d}.{name}.note").write_text(note)
    # `checkpoint` is the largest checkpoint of the daemon whose checkpoint was cosigned last
    # (else of any daemon): the file verifier checks `checkpoint.cosigned`'s origin signature
    # under `checkpoint.vkey`, so the two must be one daemon's.
    ours = [n for n in notes if cosigned is None or n[0] == cosigned[0]]
    latest = max(ours, key=lambda n: n[1], default=None)
    if latest is not None:
        (out / layout.CHECKPOINT).write_text(latest[2])
        (out / layout.CHECKPOINT_VKEY).write_text(keys[latest[0]] + "\n")
    if cosigned is not None:
        (out / "checkpoint.cosigned").write_text(cosigned[2])
    (out / "daemons.json").write_text(
        json.dumps([{"name": n, "vkey": v} for n, v in keys.items()], indent=1) + "\n"
    )
    with open(out / "writers.jsonl", "w") as f:  # noqa: ASYNC230
        for span in writers:
            f.write(json.dumps(span, sort_keys=True) + "\n")
    return {
        "dir": str(out),
        "entries": count,
        "checkpoint": None if latest is None else {"size": latest[1], "daemon": latest[0]},
        "cosigned": None if cosigned is None else {"size": cosigned[1], "daemon": cosigned[0]},
        "daemons": len(keys),
    }


def latest_note(notes: list[tuple[str, int, str]]) -> tuple[str, str] | None:
    """(daemon, note) of the largest checkpoint, parsed to be sure it is one."""
    for daemon, _, note in sorted(notes, key=lambda n: n[1], reverse=True):
        try:
            parse_note(note)
        except CheckpointError:
            continue
        return daemon, note
    return None


# ---- cosignatures in the record (`daemon.cosigning.Cosigner.cosign_shared` writes them) ----


async def joined_keys(conn: Any) -> dict[str, str]:
    """Each daemon's verifier key as its own `ledger.join` entry witnesses it in the chain: a
    `tally_daemons` row whose key is not the one its join entry (line and body re-hashed)
    names is left out, so a key slipped into the table alone is never trusted."""
    cur = await conn.execute(
        "SELECT d.name, d.vkey, e.line, b.data FROM tally_daemons d "
        "JOIN tally_entries e ON e.seq = d.joined_seq AND e.daemon = d.name "
        "JOIN tally_bodies b ON b.digest = e.body ORDER BY d.name"
    )
    keys: dict[str, str] = {}
    for name, vkey, line, data in await cur.fetchall():
        try:
            entry = Entry.from_line(bytes(line))
            body = json.loads(bytes(data)) if data is not None else None
        except ValueError:
            continue
        if (
            entry.kind == JOIN_KIND
            and data is not None
            and hashlib.sha256(bytes(data)).hexdigest() == entry.body
            and isinstance(body, dict)
            and body.get("daemon") == name
            and body.get("vkey") == vkey
        ):
            keys[name] = vkey
    return keys


async def uncosigned(conn: Any, cosigner: str) -> list[tuple[str, int, str]]:
    """(daemon, size, note): each other daemon's latest checkpoint, where it is larger than
    the last one `cosigner` cosigned for that daemon (never an older one: no rollback)."""
    cur = await conn.execute(
        "SELECT DISTINCT ON (c.daemon) c.daemon, c.size, c.note FROM tally_checkpoints c "
        "WHERE c.daemon <> %(me)s AND c.size > COALESCE((SELECT max(s.size) FROM "
        "tally_cosignatures s WHERE s.daemon = c.daemon AND s.cosigner = %(me)s), -1) "
        "ORDER BY c.daemon, c.size DESC",
        {"me": cosigner},
    )
    return [(d, int(s), n) for d, s, n in await cur.fetchall()]


async def store_cosignature(conn: Any, daemon: str, size: int, cosigner: str, line: str) -> None:
    await conn.execute(
        "INSERT INTO tally_cosignatures (daemon, size, cosigner, signature) "
        "VALUES (%s, %s, %s, %s) ON CONFLICT (daemon, size, cosigner) "
        "DO UPDATE SET signature = EXCLUDED.signature",
        (daemon, size, cosigner, line),
    )


async def latest_cosigned(conn: Any, upto: int | None = None) -> tuple[str, int, str] | None:
    """(daemon, size, note with every cosignature line stored for it) of the largest
    checkpoint that carries at least one cosignature (at most `upto` entries), or None.

    The lines are attached as stored: a verifier checks each (`verify_quorum`); a line that is
    not a well-formed signature line is left off here and so counts as missing."""
    cur = await conn.execute(
        "SELECT c.daemon, c.size, c.note FROM tally_checkpoints c WHERE EXISTS (SELECT 1 FROM "
        "tally_cosignatures s WHERE s.daemon = c.daemon AND s.size = c.size)"
        + ("" if upto is None else " AND c.size <= %(upto)s")
        + " ORDER BY c.size DESC, c.daemon LIMIT 1",
        {"upto": upto},
    )
    row = await cur.fetchone()
    if row is None:
        return None
    daemon, size, note = row[0], int(row[1]), row[2]
    return daemon, size, await with_cosignatures(conn, daemon, size, note)


async def with_cosignatures(conn: Any, daemon: str, size: int, note: str) -> str:
    """`note` (daemon's checkpoint at `size`) with every cosignature line stored for it."""
    from daemon.ledger.cosign import CosignError, attach

    cur = await conn.execute(
        "SELECT signature FROM tally_cosignatures WHERE daemon = %s AND size = %s "
        "ORDER BY cosigner",
        (daemon, size),
    )
    for (line,) in await cur.fetchall():
        try:
            note = attach(note, [line])
        except CosignError:
            continue
    return note
