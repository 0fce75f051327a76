"""The verifiable ledger: entries, Merkle proofs, group-committed appends, checkpoints."""

from daemon.ledger.audit import VerifyReport
from daemon.ledger.canonical import NotCanonical, canonical_bytes, canonicalize, check_json
from daemon.ledger.checkpoint import Checkpoint, CheckpointError, parse_note, verify_note
from daemon.ledger.entry import Entry
from daemon.ledger.errors import LedgerCorrupt, LedgerFailed, LedgerLocked
from daemon.ledger.log import ConsistencyProof, InclusionProof, Ledger, LedgerStats

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "ConsistencyProof",
    "Entry",
    "InclusionProof",
    "Ledger",
    "LedgerCorrupt",
    "LedgerFailed",
    "LedgerLocked",
    "LedgerStats",
    "NotCanonical",
    "VerifyReport",
    "canonical_bytes",
    "canonicalize",
    "check_json",
    "parse_note",
    "verify_note",
]
