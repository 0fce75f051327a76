"""A fast builder of large synthetic ledgers (benchmark and test fixtures).

It writes exactly the format `Ledger` writes (entries, index, tree levels, meta), but formats
lines from a template and fsyncs once at the end instead of once per batch. Not for real data.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

from daemon import layout
from daemon.ledger.canonical import canonicalize
from daemon.ledger.entry import GENESIS_PREV, encode_line
from daemon.ledger.merkle import leaf_hash
from daemon.ledger.store import (
    BodyStore,
    Tree,
    body_digest,
    create_dir,
    open_append,
    write_all,
    write_atomic,
)

CHUNK = 65536


def _line(seq: int, ts: int, prev: str) -> bytes:
    return (
        b'{"actor":"bench","body":null,"kind":"note","parent":null,"prev":"'
        + prev.encode()
        + b'","run":null,"seq":%d,"ts":%d,"v":1}' % (seq, ts)
    )


def build(state_dir: Path | str, n: int, body: Callable[[int], object] | None = None) -> None:
    """Create a ledger of `n` entries in an empty state dir: body-less, or with `body(seq)`
    (a value in the canonical subset) stored in the pack as `Ledger.append` would."""
    root = Path(state_dir) / layout.LEDGER
    create_dir(root)
    if (root / layout.ENTRIES).exists():
        raise FileExistsError(f"{root} already holds a ledger")
    ts = time.time_ns() // 1000
    sample = encode_line(
        seq=0, ts=ts, actor="bench", kind="note", run=None, parent=None, body=None, prev="0" * 64
    )
    assert _line(0, ts, GENESIS_PREV) == sample, "template drifted from the canonical encoding"
    tree = Tree(root, writable=True, trusted=0)
    bodies = BodyStore(root, writable=True, table_mark=0, table_count=0)
    fd = open_append(root / layout.ENTRIES)
    prev, end = GENESIS_PREV, 0
    try:
        for start in range(0, n, CHUNK):
            lines = []
            for seq in range(start, min(n, start + CHUNK)):
                if body is None:
                    line = _line(seq, ts, prev)
                else:
                    line = _body_line(bodies, canonicalize(body(seq)), seq, ts, prev)
                digest = leaf_hash(line)
                end += len(line) + 1
                tree.append(digest, end)
                lines.append(line)
                prev = digest.hex()
            lines.append(b"")
            write_all(fd, b"\n".join(lines))
            tree.flush()
        bodies.sync_pack()
        os.fsync(fd)
        tree.sync()
        bodies.sync_table()
        meta = {"size": n, "pack": bodies.mark, "bodies": bodies.count}
    finally:
        os.close(fd)
        tree.close()
        bodies.close()
    write_atomic(root / layout.META, json.dumps(meta).encode())


def _body_line(bodies: BodyStore, data: bytes, seq: int, ts: int, prev: str) -> bytes:
    digest = body_digest(data)
    if not bodies.has_live(digest):
        bodies.reserve(1)
        bodies.stage(digest, data)
        # Staged records are found only once indexed: index now so a repeated body is stored
        # once, as the ledger stores it.
        bodies.write()
        bodies.index()
    return encode_line(
        seq=seq,
        ts=ts,
        actor="bench",
        kind="note",
        run=None,
        parent=None,
        body=digest.hex(),
        prev=prev,
    )
