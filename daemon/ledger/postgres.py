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
- `tally_nodes`: the Merkle tree's complete subtree hashes above the leaves, by (level,
  index), written in the same statement as the entries that complete them. A daemon opens on
  the O(log n) nodes of the head's frontier and a proof reads only the O(log n) nodes it
  needs, in one round trip (never every leaf hash). A record made before this table is
  migrated by the first daemon that opens it (`ensure_schema`).

One piece (past 500 lines): the schema, its migration and every statement that reads the tables
without a daemon (verify, export, cosignatures) must agree on the same columns.

Everything here is blocking (psycopg's synchronous driver): the ledger runs it on its writer
thread (commits) or a worker thread (reads), as the file storage runs its file I/O.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import re
import urllib.parse
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from daemon import layout
from daemon.errors import InvalidInput
from daemon.ledger.audit import DERIVED, TAMPERED_BODIES, VerifyReport
from daemon.ledger.checkpoint import CheckpointError, parse_note, verify_note
from daemon.ledger.entry import GENESIS_PREV, Entry
from daemon.ledger.merkle import Frontier
from daemon.ledger.store import PACK_HEADER, REDACTED
from daemon.record.ledger import LedgerJoin

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
CREATE TABLE IF NOT EXISTS tally_nodes (
    level smallint NOT NULL,
    idx bigint NOT NULL,
    hash bytea NOT NULL,
    PRIMARY KEY (level, idx)
);
"""

JOIN_KIND = LedgerJoin.KIND
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


def connect(dsn: str, timeout: float = 5.0) -> Any:
    """One connection, with what a record needs on every session: commits are durable before
    they return (`synchronous_commit = on`, whatever the server's default)."""
    import psycopg

    conn = psycopg.Connection.connect(dsn, connect_timeout=max(1, int(timeout)), autocommit=True)
    conn.execute("SET synchronous_commit = on")
    return conn


def ensure_schema(conn: Any, readonly: bool = False) -> bool:
    """Create the tables once (or add `tally_nodes` to a record made before it). When they
    exist, no DDL runs: `CREATE INDEX IF NOT EXISTS` would take a share lock on the entries
    and stall the other daemons' appends. A reader (`readonly`) never creates them: a database
    without them holds no record to read. Returns whether the record has its stored nodes (a
    reader of a record made before them reads it, and serves no proof)."""
    cur = conn.execute(
        "SELECT to_regclass('tally_cosignatures') IS NOT NULL, "
        "to_regclass('tally_nodes') IS NOT NULL"
    )
    record, nodes = cur.fetchone()
    if record and nodes:
        return True
    if readonly:
        if record:
            return False
        raise LookupError(
            "no tally record in this database (its tables are missing): check the URL, or "
            "start a daemon with --ledger on it first"
        )
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (SCHEMA_LOCK,))
        conn.execute(SCHEMA)
        if record:
            _add_nodes(conn)
    return True


def _add_nodes(conn: Any) -> None:
    """Migration (in `ensure_schema`'s transaction, the head row locked so no daemon appends
    meanwhile): compute the stored nodes of a record made before `tally_nodes`, once."""
    cur = conn.execute("SELECT size FROM tally_head FOR UPDATE")
    size = int(cur.fetchone()[0])
    if conn.execute("SELECT 1 FROM tally_nodes LIMIT 1").fetchone() is not None:
        return  # another daemon added them while this one waited for the lock
    frontier = Frontier()
    with conn.cursor() as cur:  # between fetches of the leaves' server-side cursor
        for leaves in _leaf_blocks(conn, size):
            cur.executemany(
                "INSERT INTO tally_nodes (level, idx, hash) VALUES (%s, %s, %s)",
                indexed_nodes(frontier, leaves),
            )


def _leaf_blocks(conn: Any, size: int) -> Iterator[list[bytes]]:
    with conn.cursor(name="tally_leaves") as cur:
        cur.itersize = BATCH_ROWS
        cur.execute("SELECT leaf FROM tally_entries WHERE seq < %s ORDER BY seq", (size,))
        while block := cur.fetchmany(BATCH_ROWS):
            yield [bytes(leaf) for (leaf,) in block]


def indexed_nodes(frontier: Frontier, leaves: list[bytes]) -> list[tuple[int, int, bytes]]:
    """Push `leaves` on `frontier`; the interior nodes they complete as (level, index, hash).
    Nodes of one level come out of `push_many` in index order, the first at size >> level."""
    size = frontier.size
    done = frontier.push_many(leaves)
    at: dict[int, int] = {}
    out = []
    for level, digest in done:
        index = at.get(level, size >> level)
        at[level] = index + 1
        out.append((level, index, digest))
    return out


def frontier_coords(size: int) -> list[tuple[int, int]]:
    """(level, index) of the complete subtrees of a tree of `size`, largest first."""
    coords, start = [], 0
    for level in range(size.bit_length() - 1, -1, -1):
        if size >> level & 1:
            coords.append((level, start >> level))
            start += 1 << level
    return coords


NODES = """
SELECT n.level, n.idx, n.hash FROM tally_nodes n
    JOIN unnest(%(levels)s::smallint[], %(idxs)s::bigint[]) AS w(level, idx)
    ON n.level = w.level AND n.idx = w.idx
UNION ALL
SELECT 0, e.seq, e.leaf FROM tally_entries e WHERE e.seq = ANY(%(seqs)s::bigint[])
"""


def read_nodes(conn: Any, coords: Iterable[tuple[int, int]]) -> dict[tuple[int, int], bytes]:
    """The stored hashes at these (level, index) coordinates (level 0: the entries' leaves),
    in one round trip; a coordinate the record does not hold is left out."""
    levels: list[int] = []
    idxs: list[int] = []
    seqs: list[int] = []
    for level, index in coords:
        if level == 0:
            seqs.append(index)
        else:
            levels.append(level)
            idxs.append(index)
    cur = conn.execute(NODES, {"levels": levels, "idxs": idxs, "seqs": seqs})
    return {(int(lv), int(i)): bytes(h) for lv, i, h in cur.fetchall()}


def frontier_at(conn: Any, size: int) -> Frontier:
    """The record's frontier at `size`, from its O(log n) stored nodes."""
    coords = frontier_coords(size)
    found = read_nodes(conn, coords)
    missing = [c for c in coords if c not in found]
    if missing:
        level, index = missing[0]
        raise LookupError(
            f"the shared record lacks its stored Merkle node (level {level}, index {index}) "
            f"at size {size}"
        )
    return Frontier(size, [found[c] for c in coords])


def rows(conn: Any, query: str, params: tuple[Any, ...] = ()) -> Iterator[Any]:
    """A large result streamed through a server-side cursor (inside a transaction)."""
    with conn.cursor(name="tally_walk") as cur:
        cur.itersize = BATCH_ROWS
        cur.execute(query, params)
        yield from cur


def daemons(conn: Any) -> dict[str, str]:
    cur = conn.execute("SELECT name, vkey FROM tally_daemons ORDER BY name")
    return dict(cur.fetchall())


def checkpoints(conn: Any, upto: int | None = None) -> list[tuple[str, int, str]]:
    """(daemon, size, note) of every stored checkpoint (at most `upto` entries), by size."""
    cur = conn.execute(
        "SELECT daemon, size, note FROM tally_checkpoints"
        + ("" if upto is None else " WHERE size <= %s")
        + " ORDER BY size, daemon",
        () if upto is None else (upto,),
    )
    return [(d, int(s), n) for d, s, n in cur.fetchall()]


def verify_record(conn: Any, deep: bool) -> VerifyReport:
    """Walk the whole record in seq order, as `tally ledger verify` walks `entries.jsonl`:
    each line canonical and the entry it claims to be, chained to the one before, its stored
    leaf hash re-computed; the root at every daemon's stored checkpoint, and the checkpoint's
    signature by that daemon's key; with `deep`, every body re-hashed (redacted vs tampered).
    Runs in one REPEATABLE READ transaction: a snapshot, whatever daemons append meanwhile."""
    with conn.transaction():
        conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        return _walk(conn, deep)


def _walk(conn: Any, deep: bool) -> VerifyReport:
    cur = conn.execute("SELECT size FROM tally_head")
    size = int((cur.fetchone())[0])
    keys = daemons(conn)
    pending: dict[int, list[tuple[str, str]]] = {}
    warnings: list[str] = []
    for daemon, at, note in checkpoints(conn, size):
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
    completed: list[tuple[int, int, bytes]] = []  # interior nodes the walk completed
    derived: list[str] = []
    if not conn.execute("SELECT to_regclass('tally_nodes') IS NOT NULL").fetchone()[0]:
        warnings.append(
            "the record has no stored Merkle nodes yet (made before tally_nodes): the first "
            "daemon that opens it adds them"
        )
        nodes_check = False
    else:
        nodes_check = True

    def failed(seq: int, reason: str) -> VerifyReport:
        return VerifyReport(
            ok=False, size=size, root="", first_bad_seq=seq, reason=reason, warnings=warnings
        )

    for seq, line, leaf, daemon, data, found, redacted_at in rows(conn, query):
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
        done = frontier.push(computed)
        if nodes_check:
            completed.extend(n for n in done if n[0])
        if len(completed) >= BATCH_ROWS:
            wrong = _wrong_node(conn, completed)
            if wrong is not None:
                derived.append(wrong)
            completed.clear()
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
    wrong = _wrong_node(conn, completed)
    if wrong is not None:
        derived.append(wrong)
    if derived:
        return VerifyReport(
            ok=False,
            size=size,
            root=frontier.root().hex(),
            reason=DERIVED,
            derived=derived[:1],
            warnings=warnings,
        )
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


def _wrong_node(conn: Any, completed: list[tuple[int, int, bytes]]) -> str | None:
    """The first stored node that is not the one the leaves make (or is missing), as a
    `derived` problem: the entries are intact, but proofs read these nodes."""
    if not completed:
        return None
    stored = read_nodes(conn, [(level, index) for level, index, _ in completed])
    for level, index, digest in completed:
        if stored.get((level, index)) != digest:
            state = "missing" if (level, index) not in stored else "not the leaves' hash"
            return f"tally_nodes: the node at level {level}, index {index} is {state}"
    return None


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


def export_record(conn: Any, target: Path) -> dict[str, Any]:
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
    with conn.transaction():
        conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        cur = conn.execute("SELECT size FROM tally_head")
        size = int((cur.fetchone())[0])
        keys = daemons(conn)
        notes = checkpoints(conn, size)
        cosigned = latest_cosigned(conn, size)
        writers: list[dict[str, Any]] = []
        packed: set[bytes] = set()
        count = 0
        with (
            open(out / layout.ENTRIES, "wb") as entries,
            open(out / layout.BODIES_PACK, "wb") as pack,
        ):
            query = (
                "SELECT e.seq, e.line, e.daemon, e.body, b.length, b.data FROM tally_entries e "
                "LEFT JOIN tally_bodies b ON b.digest = e.body WHERE e.seq < %s ORDER BY e.seq"
            )
            for seq, line, daemon, body, length, data in rows(conn, query, (size,)):
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
    with open(out / "writers.jsonl", "w") as f:
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


def joined_keys(conn: Any) -> dict[str, str]:
    """Each daemon's verifier key as its own `ledger.join` entry witnesses it in the chain: a
    `tally_daemons` row whose key is not the one its join entry (line and body re-hashed)
    names is left out, so a key slipped into the table alone is never trusted."""
    cur = conn.execute(
        "SELECT d.name, d.vkey, e.line, b.data FROM tally_daemons d "
        "JOIN tally_entries e ON e.seq = d.joined_seq AND e.daemon = d.name "
        "JOIN tally_bodies b ON b.digest = e.body ORDER BY d.name"
    )
    keys: dict[str, str] = {}
    for name, vkey, line, data in cur.fetchall():
        try:
            entry = Entry.from_line(bytes(line))
            body = json.loads(bytes(data)) if data is not None else None
        except ValueError:
            continue
        if (
            entry.kind != LedgerJoin.KIND
            or data is None
            or hashlib.sha256(bytes(data)).hexdigest() != entry.body
        ):
            continue
        joined = LedgerJoin.parsed(body)
        if joined is not None and joined.daemon == name and joined.vkey == vkey:
            keys[name] = vkey
    return keys


def uncosigned(conn: Any, cosigner: str) -> list[tuple[str, int, str]]:
    """(daemon, size, note): each other daemon's latest checkpoint, where it is larger than
    the last one `cosigner` cosigned for that daemon (never an older one: no rollback)."""
    cur = conn.execute(
        "SELECT DISTINCT ON (c.daemon) c.daemon, c.size, c.note FROM tally_checkpoints c "
        "WHERE c.daemon <> %(me)s AND c.size > COALESCE((SELECT max(s.size) FROM "
        "tally_cosignatures s WHERE s.daemon = c.daemon AND s.cosigner = %(me)s), -1) "
        "ORDER BY c.daemon, c.size DESC",
        {"me": cosigner},
    )
    return [(d, int(s), n) for d, s, n in cur.fetchall()]


def store_cosignature(conn: Any, daemon: str, size: int, cosigner: str, line: str) -> None:
    conn.execute(
        "INSERT INTO tally_cosignatures (daemon, size, cosigner, signature) "
        "VALUES (%s, %s, %s, %s) ON CONFLICT (daemon, size, cosigner) "
        "DO UPDATE SET signature = EXCLUDED.signature",
        (daemon, size, cosigner, line),
    )


def latest_cosigned(conn: Any, upto: int | None = None) -> tuple[str, int, str] | None:
    """(daemon, size, note with every cosignature line stored for it) of the largest
    checkpoint that carries at least one cosignature (at most `upto` entries), or None.

    The lines are attached as stored: a verifier checks each (`verify_quorum`); a line that is
    not a well-formed signature line is left off here and so counts as missing."""
    cur = conn.execute(
        "SELECT c.daemon, c.size, c.note FROM tally_checkpoints c WHERE EXISTS (SELECT 1 FROM "
        "tally_cosignatures s WHERE s.daemon = c.daemon AND s.size = c.size)"
        + ("" if upto is None else " AND c.size <= %(upto)s")
        + " ORDER BY c.size DESC, c.daemon LIMIT 1",
        {"upto": upto},
    )
    row = cur.fetchone()
    if row is None:
        return None
    daemon, size, note = row[0], int(row[1]), row[2]
    return daemon, size, with_cosignatures(conn, daemon, size, note)


def with_cosignatures(conn: Any, daemon: str, size: int, note: str) -> str:
    """`note` (daemon's checkpoint at `size`) with every cosignature line stored for it."""
    from daemon.ledger.cosign import CosignError, attach

    cur = conn.execute(
        "SELECT signature FROM tally_cosignatures WHERE daemon = %s AND size = %s "
        "ORDER BY cosigner",
        (daemon, size),
    )
    for (line,) in cur.fetchall():
        try:
            note = attach(note, [line])
        except CosignError:
            continue
    return note
