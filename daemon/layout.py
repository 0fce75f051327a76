"""The state directory's layout: every file and directory tally keeps there, named once.

    STATE/                        (`Config.state_dir`; $XDG_STATE_HOME/tally by default)
      ledger/                     LEDGER: the record (one owner: the `lock` in it)
        entries.jsonl             ENTRIES: one canonical JSON line per entry (the record)
        wal                       JOURNAL: the write-ahead journal of the batch in flight
        bodies.pack               BODIES_PACK: the bodies, content-addressed records
        bodies.idx                BODIES_TABLE: hash table body hash -> pack record
        index.bin                 INDEX: per entry its leaf hash and line end (derived)
        tree/level-NN.bin         TREE, tree_level(): the Merkle tree's stored nodes (derived)
        marks.bin                 MARKS: (entries, pack bytes) at each derived sync
        meta.json                 META: how far the derived files were fsynced
        checkpoint                CHECKPOINT: the latest signed tree head (a signed note)
        checkpoint.key            CHECKPOINT_KEY: the ed25519 signing key (0600)
        checkpoint.vkey           CHECKPOINT_VKEY: its verifier key, public
        lock                      LOCK: held (flock) by the one process that owns the ledger
      clients.json                CLIENTS: the API clients and their token digests (0600)
      clients.json.lock           CLIENTS_LOCK: flocked by each change of clients.json
      http.token                  HTTP_TOKEN: the TCP listener's owner token (0600)
      runs.snapshot.json          RUNS_SNAPSHOT: the sealed run table, a replay shortcut
      model-digests.json          MODEL_DIGESTS: sha256 of model files by (path, size, mtime)
      tls/cert.pem, tls/key.pem   TLS, TLS_CERT, TLS_KEY: the self-signed listener identity
      logs/                       LOGS: the daemon's log and each model server's
        daemon.log                DAEMON_LOG
        MEMBER-INDEX.log          server_log()

Files written whole go through `daemon.files.write_atomic`, which leaves, after a crash only,
`.NAME.PID.RANDOM.tmp` files beside them: `daemon.files.temporaries` names those. A test
(tests/ledger/test_layout.py) holds every file a running daemon creates to this list.
"""

from __future__ import annotations

from pathlib import Path
from typing import Final

LEDGER: Final = "ledger"
ENTRIES: Final = "entries.jsonl"
JOURNAL: Final = "wal"
BODIES_PACK: Final = "bodies.pack"
BODIES_TABLE: Final = "bodies.idx"
INDEX: Final = "index.bin"
TREE: Final = "tree"
MARKS: Final = "marks.bin"
META: Final = "meta.json"
CHECKPOINT: Final = "checkpoint"
CHECKPOINT_KEY: Final = "checkpoint.key"
CHECKPOINT_VKEY: Final = "checkpoint.vkey"
LOCK: Final = "lock"

CLIENTS: Final = "clients.json"
CLIENTS_LOCK: Final = "clients.json.lock"
HTTP_TOKEN: Final = "http.token"
RUNS_SNAPSHOT: Final = "runs.snapshot.json"
MODEL_DIGESTS: Final = "model-digests.json"
TLS: Final = "tls"
TLS_CERT: Final = "cert.pem"
TLS_KEY: Final = "key.pem"
LOGS: Final = "logs"
DAEMON_LOG: Final = "daemon.log"

LEDGER_FILES: Final = frozenset(
    {
        ENTRIES,
        JOURNAL,
        BODIES_PACK,
        BODIES_TABLE,
        INDEX,
        MARKS,
        META,
        CHECKPOINT,
        CHECKPOINT_KEY,
        CHECKPOINT_VKEY,
        LOCK,
    }
)
STATE_FILES: Final = frozenset({CLIENTS, CLIENTS_LOCK, HTTP_TOKEN, RUNS_SNAPSHOT, MODEL_DIGESTS})
STATE_DIRS: Final = frozenset({LEDGER, TLS, LOGS})


def tree_level(level: int) -> str:
    """The file of the tree's stored nodes at `level` (subtrees of 2**level leaves), in TREE."""
    return f"level-{level:02d}.bin"


def server_log(member: str, index: int) -> str:
    """The log of a member's model server `index`, in LOGS."""
    return f"{member}-{index}.log"


def ledger_dir(state_dir: Path) -> Path:
    return state_dir / LEDGER
