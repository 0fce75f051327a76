"""The verifiable ledger: entries, Merkle proofs, group-committed appends, checkpoints."""

from daemon.ledger.audit import VerifyReport
from daemon.ledger.canonical import NotCanonical, canonical_bytes, canonicalize, check_json
from daemon.ledger.checkpoint import Checkpoint, CheckpointError, parse_note, verify_note
from daemon.ledger.entry import Entry
from daemon.ledger.errors import LedgerCorrupt, LedgerFailed, LedgerLocked, LedgerUnwritable
from daemon.ledger.log import ConsistencyProof, InclusionProof, Ledger, LedgerStats
from daemon.ledger.outage import LedgerHealth

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "ConsistencyProof",
    "Entry",
    "InclusionProof",
    "Ledger",
    "LedgerCorrupt",
    "LedgerFailed",
    "LedgerHealth",
    "LedgerLocked",
    "LedgerStats",
    "LedgerUnwritable",
    "NotCanonical",
    "VerifyReport",
    "canonical_bytes",
    "canonicalize",
    "check_json",
    "parse_note",
    "verify_note",
]
